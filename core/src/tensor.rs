//! `TensorMeta`: the tensor schema every payload and store object carries, with validation and the
//! DLPack `DLTensor` field mapping.

use crate::dtype::{DType, DlDataType};
use crate::error::{Error, Result};
use crate::memory::MemoryKind;
use crate::wire::codec::{Reader, Writer};

/// Most dimensions a tensor may have (DLPack has no limit; real tensors have a handful).
pub const MAX_RANK: usize = 16;

/// Shape, strides (in elements), byte offset, dtype and device of a tensor stored in a region.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Size of each dimension.
    pub shape: Vec<u64>,
    /// Step between consecutive indices of each dimension, in elements.
    pub strides: Vec<u64>,
    /// Offset of element 0 from the start of the region, in bytes.
    pub byte_offset: u64,
    /// Where the memory is.
    pub device: MemoryKind,
}

/// DLPack `DLTensor` fields (without the data pointer, which is the region's base).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlTensorFields {
    /// `DLDataType`.
    pub dtype: DlDataType,
    /// `DLDevice.device_type` (kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3).
    pub device_type: i32,
    /// `DLDevice.device_id`.
    pub device_id: i32,
    /// `shape[ndim]`.
    pub shape: Vec<i64>,
    /// `strides[ndim]` in elements; `None` means compact row-major.
    pub strides: Option<Vec<i64>>,
    /// `byte_offset`.
    pub byte_offset: u64,
}

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

fn invalid(msg: String) -> Error {
    Error::InvalidTensor(msg)
}

impl TensorMeta {
    /// A compact row-major host tensor at byte offset 0.
    pub fn contiguous(dtype: DType, shape: &[u64]) -> TensorMeta {
        TensorMeta {
            dtype,
            shape: shape.to_vec(),
            strides: row_major_strides(shape),
            byte_offset: 0,
            device: MemoryKind::Host,
        }
    }

    /// Number of elements (None on overflow).
    pub fn numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }

    /// Whether the tensor is compact row-major.
    pub fn is_contiguous(&self) -> bool {
        self.strides == row_major_strides(&self.shape)
    }

    /// Bytes from element 0 to one past the last element (0 for an empty tensor); errors on overflow.
    pub fn span_bytes(&self) -> Result<u64> {
        self.check_shape()?;
        if self.shape.contains(&0) {
            return Ok(0);
        }
        let mut last = 0u64;
        for (i, (&d, &s)) in self.shape.iter().zip(&self.strides).enumerate() {
            let step = (d - 1).checked_mul(s).ok_or_else(|| {
                invalid(format!("dimension {i}: ({d} - 1) * stride {s} overflows"))
            })?;
            last = last
                .checked_add(step)
                .ok_or_else(|| invalid(format!("dimension {i}: extent overflows u64")))?;
        }
        last.checked_add(1)
            .and_then(|n| n.checked_mul(self.dtype.size()))
            .ok_or_else(|| invalid("byte span overflows u64".into()))
    }

    /// One past the tensor's last byte, counted from the start of its region: `byte_offset` plus
    /// [`TensorMeta::span_bytes`]; an error when that overflows u64.
    pub fn end_bytes(&self) -> Result<u64> {
        self.byte_offset
            .checked_add(self.span_bytes()?)
            .ok_or_else(|| invalid("byte_offset + span overflows u64".into()))
    }

    /// Checks the tensor is well formed: at most `MAX_RANK` dimensions, one stride per dimension,
    /// and its end ([`TensorMeta::end_bytes`]) and compact size ([`TensorMeta::nbytes`]) fit in
    /// u64. No memory could hold or receive any other tensor, so decoders, DLPack import and
    /// chunk plans refuse the rest. (With aliasing strides, e.g. a broadcast view, the compact size
    /// exceeds the span.)
    pub fn check(&self) -> Result<()> {
        self.end_bytes()?;
        self.nbytes().map(drop)
    }

    /// Bytes the tensor's elements occupy when compact.
    pub fn nbytes(&self) -> Result<u64> {
        self.numel()
            .and_then(|n| n.checked_mul(self.dtype.size()))
            .ok_or_else(|| invalid(format!("shape {:?} overflows u64 bytes", self.shape)))
    }

    fn check_shape(&self) -> Result<()> {
        if self.shape.len() > MAX_RANK {
            return Err(invalid(format!("rank {} exceeds {MAX_RANK}", self.shape.len())));
        }
        if self.shape.len() != self.strides.len() {
            return Err(invalid(format!(
                "{} dimensions but {} strides",
                self.shape.len(),
                self.strides.len()
            )));
        }
        Ok(())
    }

    /// Checks the tensor is well formed and lies inside a region of `region_len` bytes of `kind`.
    pub fn validate_for(&self, region_len: u64, kind: MemoryKind) -> Result<()> {
        if kind != self.device {
            return Err(invalid(format!(
                "tensor is on {:?} but the region is {kind:?}",
                self.device
            )));
        }
        self.check()?;
        let end = self.end_bytes()?;
        if end > region_len {
            return Err(Error::OutOfBounds {
                what: "tensor in region".into(),
                offset: self.byte_offset,
                len: end - self.byte_offset,
                limit: region_len,
            });
        }
        Ok(())
    }

    /// The DLPack `DLTensor` fields of this tensor.
    pub fn to_dlpack(&self) -> DlTensorFields {
        let (device_type, device_id) = match self.device {
            MemoryKind::Host => (DL_CPU, 0),
            MemoryKind::HostPinned => (DL_CUDA_HOST, 0),
            MemoryKind::Device { ordinal } => (DL_CUDA, ordinal as i32),
        };
        let to_i64 = |v: &[u64]| v.iter().map(|&x| x.min(i64::MAX as u64) as i64).collect();
        DlTensorFields {
            dtype: self.dtype.to_dlpack(),
            device_type,
            device_id,
            shape: to_i64(&self.shape),
            strides: Some(to_i64(&self.strides)),
            byte_offset: self.byte_offset,
        }
    }

    /// A tensor from DLPack `DLTensor` fields; negative sizes or strides and unknown devices are errors.
    pub fn from_dlpack(dl: &DlTensorFields) -> Result<TensorMeta> {
        let dtype = DType::from_dlpack(dl.dtype)?;
        let device = match (dl.device_type, dl.device_id) {
            (DL_CPU, _) => MemoryKind::Host,
            (DL_CUDA_HOST, _) => MemoryKind::HostPinned,
            (DL_CUDA, id) if id >= 0 => MemoryKind::Device { ordinal: id as u32 },
            (t, id) => return Err(invalid(format!("unsupported DLPack device type {t} id {id}"))),
        };
        if dl.shape.len() > MAX_RANK {
            return Err(invalid(format!("rank {} exceeds {MAX_RANK}", dl.shape.len())));
        }
        let to_u64 = |v: &[i64], what: &str| -> Result<Vec<u64>> {
            v.iter()
                .enumerate()
                .map(|(i, &x)| {
                    u64::try_from(x).map_err(|_| invalid(format!("{what}[{i}] = {x} is negative")))
                })
                .collect()
        };
        let shape = to_u64(&dl.shape, "shape")?;
        let strides = match &dl.strides {
            Some(s) => to_u64(s, "strides")?,
            None => row_major_strides(&shape),
        };
        let meta = TensorMeta { dtype, shape, strides, byte_offset: dl.byte_offset, device };
        meta.check()?;
        Ok(meta)
    }

    /// Appends the wire encoding.
    pub fn encode(&self, w: &mut Writer) {
        w.u8(self.dtype.tag());
        encode_kind(w, self.device);
        w.u64(self.byte_offset);
        w.u8(self.shape.len() as u8);
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            w.u64(d).u64(s);
        }
    }

    /// Decodes what [`TensorMeta::encode`] wrote; never panics.
    pub fn decode(r: &mut Reader<'_>) -> Result<TensorMeta> {
        let dtype = DType::from_tag(r.u8()?)?;
        let device = decode_kind(r)?;
        let byte_offset = r.u64()?;
        let rank = r.u8()? as usize;
        if rank > MAX_RANK {
            return Err(Error::protocol(format!("tensor rank {rank} exceeds {MAX_RANK}")));
        }
        let mut shape = Vec::with_capacity(rank);
        let mut strides = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(r.u64()?);
            strides.push(r.u64()?);
        }
        let meta = TensorMeta { dtype, shape, strides, byte_offset, device };
        meta.check()?;
        Ok(meta)
    }
}

/// Row-major strides (in elements) for `shape`, saturating on overflow (validation reports it).
pub fn row_major_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc = acc.saturating_mul(shape[i]);
    }
    strides
}

pub(crate) fn encode_kind(w: &mut Writer, kind: MemoryKind) {
    match kind {
        MemoryKind::Host => w.u8(0),
        MemoryKind::HostPinned => w.u8(1),
        MemoryKind::Device { ordinal } => w.u8(2).u32(ordinal),
    };
}

pub(crate) fn decode_kind(r: &mut Reader<'_>) -> Result<MemoryKind> {
    Ok(match r.u8()? {
        0 => MemoryKind::Host,
        1 => MemoryKind::HostPinned,
        2 => MemoryKind::Device { ordinal: r.u32()? },
        t => return Err(Error::protocol(format!("unknown memory kind tag {t}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn contiguous_latent_span_and_validation() {
        let t = TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]);
        assert_eq!(t.nbytes().unwrap(), 4_193_280);
        assert_eq!(t.span_bytes().unwrap(), 4_193_280);
        assert!(t.is_contiguous());
        t.validate_for(4_193_280, MemoryKind::Host).unwrap();
        let err = t.validate_for(4_193_279, MemoryKind::Host).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { limit: 4_193_279, .. }), "{err}");
        assert!(matches!(
            t.validate_for(1 << 30, MemoryKind::Device { ordinal: 0 }),
            Err(Error::InvalidTensor(_))
        ));
    }

    #[test]
    fn overflow_is_an_error_not_a_panic() {
        let t = TensorMeta {
            dtype: DType::F64,
            shape: vec![u64::MAX, 3],
            strides: vec![u64::MAX, 1],
            byte_offset: 0,
            device: MemoryKind::Host,
        };
        assert!(matches!(t.span_bytes(), Err(Error::InvalidTensor(_))));
        let mut t2 = TensorMeta::contiguous(DType::U8, &[4]);
        t2.byte_offset = u64::MAX;
        assert!(t2.validate_for(u64::MAX, MemoryKind::Host).is_err());
    }

    #[test]
    fn empty_tensor_spans_zero_bytes() {
        let t = TensorMeta::contiguous(DType::F32, &[3, 0, 5]);
        assert_eq!(t.span_bytes().unwrap(), 0);
        t.validate_for(0, MemoryKind::Host).unwrap();
    }

    #[test]
    fn dlpack_round_trip_and_rejections() {
        let mut t = TensorMeta::contiguous(DType::F8E4M3, &[2, 3, 4]);
        t.strides = vec![16, 4, 1];
        t.byte_offset = 64;
        t.device = MemoryKind::Device { ordinal: 3 };
        let dl = t.to_dlpack();
        assert_eq!((dl.device_type, dl.device_id), (2, 3));
        assert_eq!(TensorMeta::from_dlpack(&dl).unwrap(), t);

        let mut compact = dl.clone();
        compact.strides = None;
        assert_eq!(TensorMeta::from_dlpack(&compact).unwrap().strides, vec![12, 4, 1]);

        let mut neg = dl.clone();
        neg.strides = Some(vec![16, -4, 1]);
        assert!(matches!(TensorMeta::from_dlpack(&neg), Err(Error::InvalidTensor(_))));
        let mut dev = dl;
        dev.device_type = 7;
        assert!(matches!(TensorMeta::from_dlpack(&dev), Err(Error::InvalidTensor(_))));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = TensorMeta::decode(&mut Reader::new(&bytes, "tensor"));
        }

        #[test]
        fn encode_decode_round_trip(shape in proptest::collection::vec(0u64..64, 0..6), off in 0u64..4096) {
            let mut t = TensorMeta::contiguous(DType::BF16, &shape);
            t.byte_offset = off;
            let mut w = Writer::new();
            t.encode(&mut w);
            let bytes = w.finish();
            let mut r = Reader::new(&bytes, "tensor");
            prop_assert_eq!(TensorMeta::decode(&mut r).unwrap(), t);
            prop_assert!(r.finish().is_ok());
        }
    }
}
