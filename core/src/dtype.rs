//! Element types and their DLPack `DLDataType` mapping.

use crate::error::{Error, Result};

/// An element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// Boolean, one byte.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single.
    F32,
    /// IEEE double.
    F64,
    /// FP8 e4m3 (the "fn" variant: finite, no infinities).
    F8E4M3,
    /// FP8 e5m2.
    F8E5M2,
}

/// DLPack's `DLDataType` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DlDataType {
    /// `DLDataTypeCode`.
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (tensorwire supports 1).
    pub lanes: u16,
}

const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_BOOL: u8 = 6;
const DL_FLOAT8_E4M3FN: u8 = 10;
const DL_FLOAT8_E5M2: u8 = 12;

const ALL: [DType; 15] = [
    DType::Bool,
    DType::U8,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
    DType::F8E5M2,
];

impl DType {
    /// Every supported dtype.
    pub fn all() -> &'static [DType] {
        &ALL
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The DLPack data type (lanes = 1).
    pub fn to_dlpack(self) -> DlDataType {
        let code = match self {
            DType::Bool => DL_BOOL,
            DType::U8 | DType::U16 | DType::U32 | DType::U64 => DL_UINT,
            DType::I8 | DType::I16 | DType::I32 | DType::I64 => DL_INT,
            DType::F16 | DType::F32 | DType::F64 => DL_FLOAT,
            DType::BF16 => DL_BFLOAT,
            DType::F8E4M3 => DL_FLOAT8_E4M3FN,
            DType::F8E5M2 => DL_FLOAT8_E5M2,
        };
        DlDataType { code, bits: (self.size() * 8) as u8, lanes: 1 }
    }

    /// The dtype for a DLPack data type; vector lanes and unknown codes are [`Error::InvalidTensor`].
    pub fn from_dlpack(dl: DlDataType) -> Result<DType> {
        if dl.lanes != 1 {
            return Err(Error::InvalidTensor(format!(
                "DLPack dtype with {} lanes: only 1 lane is supported",
                dl.lanes
            )));
        }
        ALL.iter().copied().find(|d| d.to_dlpack() == dl).ok_or_else(|| {
            Error::InvalidTensor(format!(
                "DLPack dtype code {} with {} bits has no tensorwire dtype",
                dl.code, dl.bits
            ))
        })
    }

    /// Wire tag (stable).
    pub(crate) fn tag(self) -> u8 {
        ALL.iter().position(|d| *d == self).unwrap_or(0) as u8
    }

    /// From a wire tag.
    pub(crate) fn from_tag(tag: u8) -> Result<DType> {
        ALL.get(tag as usize)
            .copied()
            .ok_or_else(|| Error::protocol(format!("unknown dtype tag {tag}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlpack_round_trip_for_every_dtype() {
        for d in DType::all() {
            assert_eq!(DType::from_dlpack(d.to_dlpack()).unwrap(), *d);
            assert_eq!(DType::from_tag(d.tag()).unwrap(), *d);
        }
        assert_eq!(DType::BF16.to_dlpack(), DlDataType { code: 4, bits: 16, lanes: 1 });
        assert_eq!(DType::F8E4M3.to_dlpack(), DlDataType { code: 10, bits: 8, lanes: 1 });
        assert_eq!(DType::F8E5M2.to_dlpack(), DlDataType { code: 12, bits: 8, lanes: 1 });
    }

    #[test]
    fn dlpack_rejects_lanes_and_unknown_codes() {
        assert!(DType::from_dlpack(DlDataType { code: 2, bits: 32, lanes: 4 }).is_err());
        assert!(DType::from_dlpack(DlDataType { code: 5, bits: 64, lanes: 1 }).is_err());
        assert!(DType::from_dlpack(DlDataType { code: 2, bits: 7, lanes: 1 }).is_err());
    }
}
