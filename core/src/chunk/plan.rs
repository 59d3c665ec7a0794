//! `ChunkPlan`: splits a tensor into K chunks along one dimension. A chunk is the list of byte ranges
//! it covers: one range when the dimension is outermost (or every leading dimension has size 1), one
//! per leading index otherwise (a [C, T, H, W] latent chunked along T is C ranges per chunk).

use crate::error::{Error, Result};
use crate::tensor::TensorMeta;

/// Most byte ranges a plan may hold in total (bounds the memory a hostile shape can demand).
pub const MAX_RANGES: u64 = 1 << 20;

/// A byte range relative to the start of the tensor's region (the tensor's `byte_offset` included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    /// Offset in bytes.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl ByteRange {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// A chunk of a plan placed in memory: which chunk, its span along the chunk dimension, and the
/// byte ranges it occupies (as offsets in the region that holds the tensor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LandedChunk {
    /// Chunk index in the plan.
    pub index: u32,
    /// First index along the chunk dimension.
    pub start: u64,
    /// One past the last index along the chunk dimension.
    pub end: u64,
    /// Its bytes, as offsets in the region.
    pub ranges: Vec<ByteRange>,
}

/// One chunk: its index, the element range `[start, end)` along the chunk dimension, and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Index in the plan.
    pub index: u32,
    /// First index along the chunk dimension.
    pub start: u64,
    /// One past the last index along the chunk dimension.
    pub end: u64,
    /// Byte ranges, in increasing offset order, adjacent ranges merged.
    pub ranges: Vec<ByteRange>,
}

impl Chunk {
    /// Total bytes of the chunk.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.len).sum()
    }
}

/// A tensor split into chunks along one dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlan {
    dim: usize,
    chunks: Vec<Chunk>,
    extent: u64,
}

impl ChunkPlan {
    /// Splits `meta` into `count` chunks along `dim` (sizes differ by at most one index). The
    /// dimensions from `dim` inwards must be dense row-major (size-1 dimensions excepted) so that a
    /// chunk is one contiguous run per leading index.
    pub fn new(meta: &TensorMeta, dim: usize, count: u32) -> Result<ChunkPlan> {
        ChunkPlan::cut(meta, dim, count)
    }

    /// [`ChunkPlan::new`]'s body, in a function of another name: mutation testing (cargo-mutants)
    /// does not look inside functions named `new`, and this one holds the plan's invariants.
    fn cut(meta: &TensorMeta, dim: usize, count: u32) -> Result<ChunkPlan> {
        // A well-formed tensor's end and compact size fit in u64: every offset below lies in
        // [byte_offset, extent] and the chunks' bytes add up to at most the compact size.
        meta.check()?;
        let extent = meta.end_bytes()?;
        let rank = meta.shape.len();
        if dim >= rank {
            return Err(Error::InvalidArgument(format!(
                "chunk dimension {dim} out of range for a rank-{rank} tensor"
            )));
        }
        let size = meta.shape[dim];
        if count == 0 || u64::from(count) > size {
            return Err(Error::InvalidArgument(format!(
                "{count} chunks along dimension {dim} of size {size}: need 1..={size}"
            )));
        }
        // Dimensions dim.. must be dense row-major: stride[k] == product of the sizes inside k.
        let dense = |k: usize| meta.shape[k + 1..].iter().fold(1u64, |a, &d| a.saturating_mul(d));
        for k in dim..rank {
            if meta.shape[k] != 1 && meta.strides[k] != dense(k) {
                return Err(Error::InvalidTensor(format!(
                    "chunking along dimension {dim} needs dimensions {dim}.. dense row-major: \
                     stride[{k}] is {} but {} is needed",
                    meta.strides[k],
                    dense(k)
                )));
            }
        }
        // Elements in one index of the chunk dimension.
        let inner = dense(dim);
        let esize = meta.dtype.size();
        let lead = &meta.shape[..dim];
        let leading: u64 = lead.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
        if leading.saturating_mul(u64::from(count)) > MAX_RANGES {
            return Err(Error::Capacity {
                what: "chunk plan byte ranges".into(),
                requested: leading.saturating_mul(u64::from(count)),
                limit: MAX_RANGES,
            });
        }
        // Byte offsets of every leading index combination, row-major.
        let mut lead_offsets = Vec::with_capacity(leading as usize);
        let mut idx = vec![0u64; dim];
        if leading > 0 {
            loop {
                let elems: u64 = idx.iter().zip(&meta.strides).map(|(i, s)| i * s).sum();
                lead_offsets.push(meta.byte_offset + elems * esize);
                let mut k = dim;
                loop {
                    if k == 0 {
                        break;
                    }
                    k -= 1;
                    idx[k] += 1;
                    if idx[k] < lead[k] {
                        break;
                    }
                    idx[k] = 0;
                }
                if idx.iter().all(|&i| i == 0) {
                    break;
                }
            }
        }
        let (base, rem) = (size / u64::from(count), size % u64::from(count));
        let mut chunks = Vec::with_capacity(count as usize);
        let mut start = 0u64;
        for index in 0..count {
            let n = base + u64::from(u64::from(index) < rem);
            let end = start + n;
            let len = n * inner * esize;
            let mut ranges: Vec<ByteRange> = Vec::new();
            for &lo in &lead_offsets {
                let r = ByteRange { offset: lo + start * inner * esize, len };
                match ranges.last_mut() {
                    Some(last) if last.end() == r.offset => last.len += r.len,
                    _ if r.len > 0 => ranges.push(r),
                    _ => {}
                }
            }
            chunks.push(Chunk { index, start, end, ranges });
            start = end;
        }
        Ok(ChunkPlan { dim, chunks, extent })
    }

    /// The chunk dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// Number of chunks.
    pub fn len(&self) -> u32 {
        self.chunks.len() as u32
    }
    /// Always false (a plan has at least one chunk).
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
    /// All chunks in index order.
    pub fn chunks(&self) -> &[Chunk] {
        &self.chunks
    }
    /// One chunk.
    pub fn chunk(&self, index: u32) -> Result<&Chunk> {
        self.chunks.get(index as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("chunk {index} of a {}-chunk plan", self.chunks.len()))
        })
    }
    /// Chunk `index` as it lies in memory whose tensor storage starts at `base`.
    pub fn landed(&self, index: u32, base: u64) -> Result<LandedChunk> {
        let c = self.chunk(index)?;
        let ranges =
            c.ranges.iter().map(|r| ByteRange { offset: base + r.offset, len: r.len }).collect();
        Ok(LandedChunk { index, start: c.start, end: c.end, ranges })
    }
    /// One past the last byte any chunk touches (relative to the region start).
    pub fn extent(&self) -> u64 {
        self.extent
    }
    /// Total bytes over all chunks.
    pub fn total_bytes(&self) -> u64 {
        self.chunks.iter().map(Chunk::bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn outermost_dimension_gives_one_range_per_chunk() {
        let t = TensorMeta::contiguous(DType::F32, &[10, 4]);
        let p = ChunkPlan::new(&t, 0, 3).unwrap();
        let sizes: Vec<_> = p.chunks().iter().map(|c| (c.start, c.end, c.ranges.clone())).collect();
        assert_eq!(
            sizes,
            vec![
                (0, 4, vec![ByteRange { offset: 0, len: 64 }]),
                (4, 7, vec![ByteRange { offset: 64, len: 48 }]),
                (7, 10, vec![ByteRange { offset: 112, len: 48 }]),
            ]
        );
        assert_eq!(p.total_bytes(), 160);
    }

    #[test]
    fn latent_along_t_gives_c_ranges_per_chunk() {
        let t = TensorMeta::contiguous(DType::BF16, &[16, 21, 60, 104]);
        let p = ChunkPlan::new(&t, 1, 7).unwrap();
        assert_eq!(p.len(), 7);
        let frame = 60 * 104 * 2;
        for c in p.chunks() {
            assert_eq!(c.ranges.len(), 16);
            assert_eq!(c.end - c.start, 3);
            for (ch, r) in c.ranges.iter().enumerate() {
                assert_eq!(r.offset, (ch as u64 * 21 + c.start) * frame);
                assert_eq!(r.len, 3 * frame);
            }
        }
        assert_eq!(p.total_bytes(), t.nbytes().unwrap());
    }

    #[test]
    fn size_one_leading_dims_merge_into_one_range() {
        let t = TensorMeta::contiguous(DType::U8, &[1, 8, 2]);
        let p = ChunkPlan::new(&t, 1, 2).unwrap();
        assert_eq!(p.chunk(1).unwrap().ranges, vec![ByteRange { offset: 8, len: 8 }]);
    }

    #[test]
    fn rows_that_follow_each_other_in_memory_are_one_range() {
        // One chunk along dimension 1 takes both leading rows whole: 0..48 and 48..96 are one run.
        let t = TensorMeta::contiguous(DType::F32, &[2, 4, 3]);
        let p = ChunkPlan::new(&t, 1, 1).unwrap();
        assert_eq!(p.chunk(0).unwrap().ranges, vec![ByteRange { offset: 0, len: 96 }]);
        // Two chunks: each row's half is its own run.
        let p = ChunkPlan::new(&t, 1, 2).unwrap();
        assert_eq!(
            p.chunk(1).unwrap().ranges,
            vec![ByteRange { offset: 24, len: 24 }, ByteRange { offset: 72, len: 24 }]
        );
    }

    #[test]
    fn strided_leading_dimension_and_byte_offset() {
        // A [2, 4] view with row stride 6 (padding), starting 16 bytes in.
        let mut t = TensorMeta::contiguous(DType::U16, &[2, 4]);
        t.strides = vec![6, 1];
        t.byte_offset = 16;
        let p = ChunkPlan::new(&t, 1, 2).unwrap();
        assert_eq!(
            p.chunk(0).unwrap().ranges,
            vec![ByteRange { offset: 16, len: 4 }, ByteRange { offset: 28, len: 4 }]
        );
        assert_eq!(p.extent(), 16 + (6 + 4) * 2);
    }

    #[test]
    fn a_tensor_ending_past_u64_is_refused() {
        // Found by the chunk_plan fuzz target: byte_offset + span wrapped, so the plan's extent
        // ended before its ranges did.
        let t = TensorMeta {
            dtype: DType::Bool,
            shape: vec![3026418949606408258],
            strides: vec![1],
            byte_offset: 18373393454000618752,
            device: crate::MemoryKind::Host,
        };
        assert!(matches!(ChunkPlan::new(&t, 0, 63), Err(Error::InvalidTensor(_))));
        let mut w = crate::wire::codec::Writer::new();
        t.encode(&mut w);
        let bytes = w.finish();
        let decoded = TensorMeta::decode(&mut crate::wire::codec::Reader::new(&bytes, "test"));
        assert!(matches!(decoded, Err(Error::InvalidTensor(_))), "{decoded:?}");
    }

    #[test]
    fn a_tensor_whose_compact_size_overflows_is_refused() {
        // Found by the chunk_plan fuzz target: aliasing leading strides keep the span small while
        // the element count overflows, so the chunks' byte total did.
        let t = TensorMeta {
            dtype: DType::F16,
            shape: vec![2, 3, 0x4c00_0000_0000_0001],
            strides: vec![12, 4, 1],
            byte_offset: 0,
            device: crate::MemoryKind::Host,
        };
        assert!(t.end_bytes().is_ok());
        assert!(matches!(ChunkPlan::new(&t, 2, 2), Err(Error::InvalidTensor(_))));
    }

    #[test]
    fn bad_plans_are_errors() {
        let t = TensorMeta::contiguous(DType::F32, &[4, 4]);
        assert!(matches!(ChunkPlan::new(&t, 2, 1), Err(Error::InvalidArgument(_))));
        assert!(matches!(ChunkPlan::new(&t, 0, 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(ChunkPlan::new(&t, 0, 5), Err(Error::InvalidArgument(_))));
        let mut tr = t.clone();
        tr.strides = vec![1, 4]; // column-major
        assert!(matches!(ChunkPlan::new(&tr, 0, 2), Err(Error::InvalidTensor(_))));
        let huge = TensorMeta::contiguous(DType::U8, &[1 << 20, 2, 1]);
        assert!(matches!(ChunkPlan::new(&huge, 1, 2), Err(Error::Capacity { .. })));
        // The bound on ranges is inclusive: MAX_RANGES ranges are a plan, one more is not.
        let at_bound = TensorMeta::contiguous(DType::U8, &[MAX_RANGES / 2, 2, 1]);
        assert_eq!(ChunkPlan::new(&at_bound, 1, 2).unwrap().len(), 2);
        let past = TensorMeta::contiguous(DType::U8, &[MAX_RANGES / 2 + 1, 2, 1]);
        assert!(matches!(ChunkPlan::new(&past, 1, 2), Err(Error::Capacity { .. })));
        // Padding on the chunk dimension itself: a [2, 3, 4] u16 tensor whose dimension 1 has
        // stride 5 (4 is dense) cannot be cut along 1 into runs of its own bytes.
        let mut padded = TensorMeta::contiguous(DType::U16, &[2, 3, 4]);
        padded.strides = vec![15, 5, 1];
        for count in 1..=3 {
            assert!(matches!(ChunkPlan::new(&padded, 1, count), Err(Error::InvalidTensor(_))));
        }
        // ... while along dimension 0 its rows are not runs either (stride 15, not 12).
        assert!(matches!(ChunkPlan::new(&padded, 0, 2), Err(Error::InvalidTensor(_))));
        // And along 2, each (i, j) row is a run: 6 ranges per chunk, each of its own bytes.
        let p = ChunkPlan::new(&padded, 2, 2).unwrap();
        assert_eq!(p.chunk(0).unwrap().ranges.len(), 6);
        assert_eq!(plan_bytes(&p), tensor_bytes(&padded));
    }

    /// Every byte address of every element of `t`.
    fn tensor_bytes(t: &TensorMeta) -> std::collections::BTreeSet<u64> {
        element_bytes(t, None)
    }

    /// The byte addresses of the elements of `t` (whose index along `along.0` lies in
    /// `along.1`, when given), computed from shape, strides and offset alone.
    fn element_bytes(
        t: &TensorMeta,
        along: Option<(usize, std::ops::Range<u64>)>,
    ) -> std::collections::BTreeSet<u64> {
        let mut out = std::collections::BTreeSet::new();
        if t.shape.contains(&0) {
            return out;
        }
        let esize = t.dtype.size();
        let mut idx = vec![0u64; t.shape.len()];
        loop {
            if along.as_ref().is_none_or(|(d, r)| r.contains(&idx[*d])) {
                let elem: u64 = idx.iter().zip(&t.strides).map(|(i, s)| i * s).sum();
                let at = t.byte_offset + elem * esize;
                out.extend(at..at + esize);
            }
            // Next index, row-major; done once every digit wrapped.
            let mut k = idx.len();
            loop {
                if k == 0 {
                    return out;
                }
                k -= 1;
                idx[k] += 1;
                if idx[k] < t.shape[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
    }

    /// The byte addresses the ranges of `ranges` cover; panics if two ranges overlap.
    fn range_bytes<'a>(
        ranges: impl IntoIterator<Item = &'a ByteRange>,
    ) -> std::collections::BTreeSet<u64> {
        let mut out = std::collections::BTreeSet::new();
        for r in ranges {
            for b in r.offset..r.end() {
                assert!(out.insert(b), "byte {b} is in two ranges");
            }
        }
        out
    }

    fn plan_bytes(p: &ChunkPlan) -> std::collections::BTreeSet<u64> {
        range_bytes(p.chunks().iter().flat_map(|c| &c.ranges))
    }

    /// A layout for `shape`: row-major over the dimensions in `order` (outermost first), each
    /// dimension padded by `pads[k]` elements (so strides leave gaps where pads are not 0).
    fn layout(shape: &[u64], order: &[usize], pads: &[u64]) -> Vec<u64> {
        let mut strides = vec![0u64; shape.len()];
        let mut step = 1u64;
        for &k in order.iter().rev() {
            strides[k] = step + pads[k];
            step = strides[k] * shape[k].max(1);
        }
        strides
    }

    proptest::proptest! {
        /// Strided tensors (transposed, padded on any dimension, the chunk dimension included,
        /// offset), every dimension and count: an error, or a plan whose ranges are disjoint, cover
        /// exactly the tensor's bytes (no padding, nothing missing), and whose chunk `c` covers
        /// exactly the bytes of the elements with an index in `c.start..c.end` along the chunk
        /// dimension. A layout that is dense from the chunk dimension inwards always gets a plan.
        #[test]
        fn plans_cover_exactly_the_tensors_bytes(
            shape in proptest::collection::vec(proptest::prop_oneof![9 => 1u64..5, 1 => proptest::strategy::Just(0u64)], 1..5),
            order_seed in proptest::collection::vec(0usize..4, 4),
            pads in proptest::collection::vec(proptest::prop_oneof![3 => proptest::strategy::Just(0u64), 1 => 1u64..4], 4),
            offset in 0u64..8,
            dim in 0usize..4,
            count in 1u32..5,
        ) {
            let rank = shape.len();
            let mut order: Vec<usize> = (0..rank).collect();
            for (i, &s) in order_seed.iter().enumerate().take(rank) {
                order.swap(i, s % rank);
            }
            let mut t = TensorMeta::contiguous(DType::U16, &shape);
            t.strides = layout(&shape, &order, &pads[..rank]);
            t.byte_offset = offset * 2;
            let dim = dim % rank;
            let count = count.min(shape[dim] as u32);
            let dense_inside = (dim..rank).all(|k| {
                shape[k] == 1 || t.strides[k] == shape[k + 1..].iter().product::<u64>()
            });
            match ChunkPlan::new(&t, dim, count) {
                Ok(p) => {
                    proptest::prop_assert_eq!(plan_bytes(&p), tensor_bytes(&t));
                    for c in p.chunks() {
                        let want = element_bytes(&t, Some((dim, c.start..c.end)));
                        proptest::prop_assert_eq!(range_bytes(&c.ranges), want);
                        // No empty range, and none that the next (in index order) continues:
                        // runs that follow each other in memory are one range.
                        proptest::prop_assert!(c.ranges.iter().all(|r| r.len > 0), "{:?}", c.ranges);
                        for w in c.ranges.windows(2) {
                            proptest::prop_assert!(w[0].end() != w[1].offset, "{:?}", c.ranges);
                        }
                    }
                }
                Err(e) => proptest::prop_assert!(
                    !dense_inside || shape[dim] == 0,
                    "a dense layout refused: {e}"
                ),
            }
        }

        /// Arbitrary tensors, dimensions and counts: an error or a plan whose ranges stay inside the
        /// tensor and add up to the tensor's bytes; never a panic.
        #[test]
        fn arbitrary_plans_never_panic(
            shape in proptest::collection::vec(0u64..9, 0..5),
            strides in proptest::collection::vec(0u64..300, 0..5),
            offset in 0u64..100,
            dim in 0usize..5,
            count in 0u32..10,
        ) {
            let mut t = TensorMeta::contiguous(DType::U16, &shape);
            if strides.len() == shape.len() && offset % 2 == 1 {
                t.strides = strides;
            }
            t.byte_offset = offset;
            if let Ok(p) = ChunkPlan::new(&t, dim, count) {
                let mut covered = 0;
                for c in p.chunks() {
                    for r in &c.ranges {
                        proptest::prop_assert!(r.offset >= offset && r.end() <= p.extent());
                        covered += r.len;
                    }
                }
                proptest::prop_assert_eq!(covered, t.nbytes().unwrap());
            }
        }
    }

    #[test]
    fn empty_leading_dimension_gives_empty_chunks() {
        let t = TensorMeta::contiguous(DType::F32, &[0, 4]);
        let p = ChunkPlan::new(&t, 1, 2).unwrap();
        assert!(p.chunks().iter().all(|c| c.ranges.is_empty()));
    }

    #[test]
    fn an_empty_inner_dimension_gives_chunks_without_ranges() {
        // Two leading rows, each contributing a zero-byte run to every chunk: none is a range.
        let t = TensorMeta::contiguous(DType::F32, &[2, 3, 0]);
        let p = ChunkPlan::new(&t, 1, 3).unwrap();
        assert_eq!(p.len(), 3);
        for c in p.chunks() {
            assert!(c.ranges.is_empty(), "chunk {}: {:?}", c.index, c.ranges);
            assert_eq!(c.end - c.start, 1);
        }
        assert_eq!(p.total_bytes(), 0);
    }
}
