//! The export of one device allocation as the cuda backend's grants carry it (the share bytes of
//! the same-host protocol, see `tensorwire_shm::wire`): which process and GPU exported it, where
//! it lives there, how long it is, and the driver's IPC handle. A pure codec, total on any input.
//!
//! ```text
//! 0..2 magic "TI"  2 version  3 kind (1: cuIpcGetMemHandle handle)  4..12 exporting process
//! 12..28 device UUID  28..36 address in the exporter  36..44 length  44..108 IPC handle
//! ```
//! The exporting process is a random token drawn once per process, not its pid: two containers
//! of one host can share a pid, and an address is only meaningful in the process that made it.

use tensorwire_core::backend::kit::{Framing, Reader, Writer};
use tensorwire_core::{Error, Result};

/// Encoded length.
pub const SHARE_LEN: usize = 108;
/// The share's magic ("TI") and version.
pub const FRAMING: Framing =
    Framing { name: "cuda IPC share", magic: *b"TI", version: 1, max_payload: SHARE_LEN as u32 };
/// A legacy IPC handle (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`).
pub const KIND_LEGACY: u8 = 1;

/// One exported device allocation (the whole allocation: the backend shares no other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcShare {
    /// The exporting process (its token, see the module docs).
    pub process: u64,
    /// The GPU it lives on (ordinals differ between processes; UUIDs do not).
    pub uuid: [u8; 16],
    /// Its address in the exporting process.
    pub addr: u64,
    /// Its length (the region's).
    pub len: u64,
    /// The driver's handle.
    pub handle: [u8; 64],
}

impl IpcShare {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.raw(&FRAMING.magic).u8(FRAMING.version).u8(KIND_LEGACY);
        w.u64(self.process).raw(&self.uuid);
        w.u64(self.addr).u64(self.len).raw(&self.handle);
        w.finish()
    }

    /// Decodes and validates (length, magic, version, kind, a non-empty allocation that does not
    /// wrap the address space). Never panics.
    pub fn decode(b: &[u8]) -> Result<IpcShare> {
        if b.len() != SHARE_LEN {
            return Err(Error::protocol(format!(
                "cuda: an IPC share of {} bytes, expected {SHARE_LEN}",
                b.len()
            )));
        }
        let mut r = Reader::new(b, "cuda IPC share");
        FRAMING.check_prefix(r.raw(3)?)?;
        match r.u8()? {
            KIND_LEGACY => {}
            k => return Err(Error::protocol(format!("cuda: IPC share of kind {k}"))),
        }
        let process = r.u64()?;
        let uuid = r.raw(16)?.try_into().map_err(|_| Error::protocol("cuda: uuid"))?;
        let (addr, len) = (r.u64()?, r.u64()?);
        let handle = r.raw(64)?.try_into().map_err(|_| Error::protocol("cuda: handle"))?;
        r.finish()?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::protocol(format!("cuda: an IPC share of {len} bytes at {addr:#x}")));
        }
        Ok(IpcShare { process, uuid, addr, len, handle })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn share() -> IpcShare {
        IpcShare {
            process: 7,
            uuid: [3; 16],
            addr: 0x7f00_0000_0000,
            len: 1 << 20,
            handle: [9; 64],
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let s = share();
        let b = s.encode();
        assert_eq!(b.len(), SHARE_LEN);
        assert_eq!(IpcShare::decode(&b).unwrap(), s);
        assert!(IpcShare::decode(&b[..SHARE_LEN - 1]).is_err(), "short");
        for (at, v) in [(0, b'X'), (2, 2), (3, 2)] {
            let mut bad = b.clone();
            bad[at] = v;
            assert!(IpcShare::decode(&bad).is_err(), "byte {at} = {v}");
        }
        assert!(IpcShare::decode(&IpcShare { len: 0, ..s }.encode()).is_err(), "empty");
        let wraps = IpcShare { addr: u64::MAX - 10, len: 11, ..s };
        assert!(IpcShare::decode(&wraps.encode()).is_err(), "wraps");
    }

    proptest! {
        #[test]
        fn decode_is_total(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            let _ = IpcShare::decode(&bytes);
        }

        #[test]
        fn decoded_shares_round_trip(mut bytes in proptest::collection::vec(any::<u8>(), SHARE_LEN)) {
            bytes[..2].copy_from_slice(&FRAMING.magic);
            bytes[2..4].copy_from_slice(&[FRAMING.version, KIND_LEGACY]);
            if let Ok(s) = IpcShare::decode(&bytes) {
                prop_assert_eq!(s.encode(), bytes);
            }
        }
    }
}
