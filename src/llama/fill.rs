//! Synthesising a llama.cpp sequence state: a KV cache that holds positions
//! 0..n-1 of one sequence without computing them (`Reference::fill_kv`).
//!
//! The blob format is the one `llama_state_seq_get_data` writes and
//! `llama_state_seq_set_data` reads in the pinned llama.cpp
//! (llama-context.cpp `state_seq_*`, llama-kv-cache.cpp `state_write*` /
//! `state_read*`), all fields native-endian:
//!
//! ```text
//! u32 magic (0xaf143cd8), i32 seq_id
//! per KV cache (one; two for an iSWA model: base, then SWA):
//!   u32 n_stream
//!   per stream: u32 cell_count; when > 0:
//!     meta, per cell:  i32 pos, u32 n_seq_id (= 1), [12-byte cell ext], i32 seq_id
//!     u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
//!     per layer:        i32 k_type, u64 k_row_size, cell_count K rows
//!     v_trans == 0, per layer with V: i32 v_type, u64 v_row_size, cell_count V rows
//!     v_trans == 1, per layer with V: i32 v_type, u32 v_el_size, u32 n_embd_v_gqa,
//!                                     n_embd_v_gqa times cell_count elements
//! ```
//!
//! Rather than recomputing types, row sizes, rotations and the like from the
//! model's hyper-parameters, the layout is *learned*: one real token is
//! decoded, its one-cell state is read back and parsed here, and the n-cell
//! state is built from it, every cell a copy of that real cell (finite values
//! of the right magnitude and a valid encoding for any KV type, quantised
//! ones included). Whether the cells carry the optional 12-byte ext and how
//! many layers have a V tensor is settled by the parse that consumes the
//! blob exactly.

/// The magic llama.cpp writes at the head of a sequence state.
pub(crate) const SEQ_STATE_MAGIC: u32 = 0xaf14_3cd8;
const CELL_EXT_BYTES: usize = 12;

/// One cache row (K, or V untransposed) of a layer.
#[derive(Debug, Clone)]
struct Rows {
    ty: i32,
    row: Vec<u8>,
}

/// One transposed V tensor of a layer: `n_embd` elements of one cell.
#[derive(Debug, Clone)]
struct TransV {
    ty: i32,
    el: u32,
    n_embd: u32,
    elems: Vec<u8>,
}

#[derive(Debug, Clone)]
enum VPart {
    Rows(Vec<Rows>),
    Trans(Vec<TransV>),
}

/// The one learned cell of a non-empty stream.
#[derive(Debug, Clone)]
struct Stream {
    ext: Option<[u8; CELL_EXT_BYTES]>,
    v_trans: u32,
    n_layer: u32,
    n_rot_k: u32,
    n_rot_v: u32,
    k: Vec<Rows>,
    v: VPart,
}

/// One KV cache's part of the state: its streams (None: empty there).
#[derive(Debug, Clone)]
struct Section {
    streams: Vec<Option<Stream>>,
}

/// The layout of a one-cell sequence state, ready to be replicated.
#[derive(Debug, Clone)]
pub(crate) struct SeqLayout {
    sections: Vec<Section>,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.b.get(self.at..end)?;
        self.at = end;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.bytes(4)?.try_into().ok()?))
    }
    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_ne_bytes(self.bytes(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_ne_bytes(self.bytes(8)?.try_into().ok()?))
    }
    fn done(&self) -> bool {
        self.at == self.b.len()
    }
}

/// Plausible ggml type id (GGML_TYPE_COUNT is below 64 in every version).
fn sane_type(t: i32) -> bool {
    (0..64).contains(&t)
}

/// Parses one non-empty stream holding exactly one cell.
fn parse_stream(r: &mut Reader, ext: bool, v_layers_all: bool) -> Option<Stream> {
    let _pos = r.i32()?;
    if r.u32()? != 1 {
        return None; // n_seq_id
    }
    let ext = if ext {
        Some(r.bytes(CELL_EXT_BYTES)?.try_into().ok()?)
    } else {
        None
    };
    let _seq = r.i32()?;
    let v_trans = r.u32()?;
    let n_layer = r.u32()?;
    let n_rot_k = r.u32()?;
    let n_rot_v = r.u32()?;
    if v_trans > 1 || n_layer == 0 || n_layer > 4096 {
        return None;
    }
    let mut k = Vec::with_capacity(n_layer as usize);
    for _ in 0..n_layer {
        let ty = r.i32()?;
        let size = r.u64()?;
        if !sane_type(ty) || size == 0 || size > (1 << 30) {
            return None;
        }
        k.push(Rows {
            ty,
            row: r.bytes(size as usize)?.to_vec(),
        });
    }
    let n_v = if v_layers_all { n_layer } else { 0 };
    let v = if v_trans == 0 {
        let mut v = Vec::with_capacity(n_v as usize);
        for _ in 0..n_v {
            let ty = r.i32()?;
            let size = r.u64()?;
            if !sane_type(ty) || size == 0 || size > (1 << 30) {
                return None;
            }
            v.push(Rows {
                ty,
                row: r.bytes(size as usize)?.to_vec(),
            });
        }
        VPart::Rows(v)
    } else {
        let mut v = Vec::with_capacity(n_v as usize);
        for _ in 0..n_v {
            let ty = r.i32()?;
            let el = r.u32()?;
            let n_embd = r.u32()?;
            if !sane_type(ty) || el == 0 || el > 64 || n_embd == 0 || n_embd > (1 << 24) {
                return None;
            }
            v.push(TransV {
                ty,
                el,
                n_embd,
                elems: r.bytes(el as usize * n_embd as usize)?.to_vec(),
            });
        }
        VPart::Trans(v)
    };
    Some(Stream {
        ext,
        v_trans,
        n_layer,
        n_rot_k,
        n_rot_v,
        k,
        v,
    })
}

fn parse_with(blob: &[u8], ext: bool, v_layers_all: bool) -> Option<SeqLayout> {
    let mut r = Reader { b: blob, at: 0 };
    if r.u32()? != SEQ_STATE_MAGIC {
        return None;
    }
    let _seq = r.i32()?;
    let mut sections = Vec::new();
    while !r.done() {
        let n_stream = r.u32()?;
        if n_stream == 0 || n_stream > 4096 {
            return None;
        }
        let mut streams = Vec::with_capacity(n_stream as usize);
        let mut cells = 0;
        for _ in 0..n_stream {
            match r.u32()? {
                0 => streams.push(None),
                1 => {
                    cells += 1;
                    streams.push(Some(parse_stream(&mut r, ext, v_layers_all)?));
                }
                _ => return None,
            }
        }
        if cells != 1 {
            return None;
        }
        sections.push(Section { streams });
    }
    if sections.is_empty() {
        return None;
    }
    Some(SeqLayout { sections })
}

impl SeqLayout {
    /// Learns the layout from the state of a sequence that holds exactly one cell.
    pub(crate) fn learn(blob: &[u8]) -> Result<SeqLayout, String> {
        if blob.len() < 8 {
            return Err(format!("a {}-byte state is too short", blob.len()));
        }
        let magic = u32::from_ne_bytes(blob[..4].try_into().expect("4 bytes"));
        if magic != SEQ_STATE_MAGIC {
            return Err(format!(
                "magic {magic:#010x}, expected {SEQ_STATE_MAGIC:#010x}"
            ));
        }
        let mut found = Vec::new();
        for ext in [false, true] {
            for v_all in [true, false] {
                if let Some(l) = parse_with(blob, ext, v_all) {
                    found.push(l);
                }
            }
        }
        match found.len() {
            1 => Ok(found.pop().expect("one")),
            0 => Err(format!(
                "a {}-byte one-cell state matches no known KV-cache layout \
                 (not a plain or iSWA attention cache?)",
                blob.len()
            )),
            k => Err(format!(
                "a {}-byte one-cell state parses {k} ways",
                blob.len()
            )),
        }
    }

    /// Number of KV layers of the first cache (for messages and tests).
    pub(crate) fn n_layer(&self) -> u32 {
        self.sections
            .iter()
            .flat_map(|s| s.streams.iter().flatten())
            .map(|s| s.n_layer)
            .next()
            .unwrap_or(0)
    }

    /// Exact size of the state for `n` cells.
    pub(crate) fn size(&self, n: usize) -> usize {
        let mut t = 8;
        for sec in &self.sections {
            t += 4 + 4 * sec.streams.len();
            for st in sec.streams.iter().flatten() {
                let meta = 12 + st.ext.map_or(0, |e| e.len());
                t += n * meta + 16;
                t += st.k.iter().map(|k| 12 + n * k.row.len()).sum::<usize>();
                t += match &st.v {
                    VPart::Rows(v) => v.iter().map(|v| 12 + n * v.row.len()).sum::<usize>(),
                    VPart::Trans(v) => v.iter().map(|v| 12 + n * v.elems.len()).sum::<usize>(),
                };
            }
        }
        t
    }

    /// The state of sequence `seq` holding positions 0..n-1, each cell a copy
    /// of the learned one; built in one allocation of exactly `size(n)` bytes.
    pub(crate) fn build(&self, seq: i32, n: u32) -> Vec<u8> {
        let n = n as usize;
        let total = self.size(n);
        let mut b: Vec<u8> = Vec::with_capacity(total);
        b.extend_from_slice(&SEQ_STATE_MAGIC.to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        for sec in &self.sections {
            b.extend_from_slice(&(sec.streams.len() as u32).to_ne_bytes());
            for st in &sec.streams {
                let Some(st) = st else {
                    b.extend_from_slice(&0u32.to_ne_bytes());
                    continue;
                };
                b.extend_from_slice(&(n as u32).to_ne_bytes());
                for pos in 0..n {
                    b.extend_from_slice(&(pos as i32).to_ne_bytes());
                    b.extend_from_slice(&1u32.to_ne_bytes());
                    if let Some(e) = &st.ext {
                        b.extend_from_slice(e);
                    }
                    b.extend_from_slice(&seq.to_ne_bytes());
                }
                for x in [st.v_trans, st.n_layer, st.n_rot_k, st.n_rot_v] {
                    b.extend_from_slice(&x.to_ne_bytes());
                }
                for k in &st.k {
                    b.extend_from_slice(&k.ty.to_ne_bytes());
                    b.extend_from_slice(&(k.row.len() as u64).to_ne_bytes());
                    repeat(&mut b, &k.row, n);
                }
                match &st.v {
                    VPart::Rows(v) => {
                        for v in v {
                            b.extend_from_slice(&v.ty.to_ne_bytes());
                            b.extend_from_slice(&(v.row.len() as u64).to_ne_bytes());
                            repeat(&mut b, &v.row, n);
                        }
                    }
                    VPart::Trans(v) => {
                        for v in v {
                            b.extend_from_slice(&v.ty.to_ne_bytes());
                            b.extend_from_slice(&v.el.to_ne_bytes());
                            b.extend_from_slice(&v.n_embd.to_ne_bytes());
                            // row j of the transposed tensor: element j of every cell
                            for e in v.elems.chunks_exact(v.el as usize) {
                                repeat(&mut b, e, n);
                            }
                        }
                    }
                }
            }
        }
        debug_assert_eq!(b.len(), total);
        b
    }
}

/// Appends `n` copies of `pat`, doubling the copied run (log n memcpys).
fn repeat(b: &mut Vec<u8>, pat: &[u8], n: usize) {
    if n == 0 || pat.is_empty() {
        return;
    }
    let start = b.len();
    b.extend_from_slice(pat);
    let mut have = 1;
    while have < n {
        let take = have.min(n - have);
        b.extend_from_within(start..start + take * pat.len());
        have += take;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-cell state as llama.cpp writes it: one cache, one stream.
    fn one_cell(ext: bool, v_trans: bool, n_layer: u32, row: usize) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&SEQ_STATE_MAGIC.to_ne_bytes());
        b.extend_from_slice(&0i32.to_ne_bytes());
        b.extend_from_slice(&1u32.to_ne_bytes()); // n_stream
        b.extend_from_slice(&1u32.to_ne_bytes()); // cell_count
        b.extend_from_slice(&0i32.to_ne_bytes()); // pos
        b.extend_from_slice(&1u32.to_ne_bytes()); // n_seq_id
        if ext {
            b.extend_from_slice(&[0u8; 8]);
            b.extend_from_slice(&7i32.to_ne_bytes());
        }
        b.extend_from_slice(&0i32.to_ne_bytes()); // seq
        for x in [v_trans as u32, n_layer, 0, 0] {
            b.extend_from_slice(&x.to_ne_bytes());
        }
        for l in 0..n_layer {
            b.extend_from_slice(&1i32.to_ne_bytes());
            b.extend_from_slice(&(row as u64).to_ne_bytes());
            b.extend((0..row).map(|i| (i as u8) ^ (l as u8)));
        }
        for l in 0..n_layer {
            b.extend_from_slice(&1i32.to_ne_bytes());
            if v_trans {
                b.extend_from_slice(&2u32.to_ne_bytes());
                b.extend_from_slice(&((row / 2) as u32).to_ne_bytes());
            } else {
                b.extend_from_slice(&(row as u64).to_ne_bytes());
            }
            b.extend((0..row).map(|i| (i as u8).wrapping_add(l as u8)));
        }
        b
    }

    #[test]
    fn one_cell_round_trips() {
        for ext in [false, true] {
            for vt in [false, true] {
                let blob = one_cell(ext, vt, 3, 16);
                let l = SeqLayout::learn(&blob).expect("learns");
                assert_eq!(l.n_layer(), 3);
                assert_eq!(l.build(0, 1), blob, "ext {ext} v_trans {vt}");
                assert_eq!(l.size(1000), l.build(0, 1000).len());
            }
        }
    }

    #[test]
    fn transposed_v_is_element_major() {
        let blob = one_cell(false, true, 1, 4);
        let l = SeqLayout::learn(&blob).expect("learns");
        let b = l.build(0, 3);
        // V payload: element 0 three times, then element 1 three times
        let v = &b[b.len() - 12..];
        assert_eq!(v, &[0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]);
    }

    #[test]
    fn rejects_garbage() {
        assert!(SeqLayout::learn(&[0u8; 4]).is_err());
        let mut blob = one_cell(false, false, 2, 8);
        blob.push(0);
        assert!(SeqLayout::learn(&blob).is_err());
    }
}
