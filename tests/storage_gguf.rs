//! A GGUF whose tensors are not 4096-aligned (alignment 32, odd sizes)
//! still streams through the SSD-tier reader: each tensor's aligned window
//! is read and its bytes found at the returned offset, on every backend.

mod storage_util;

use storage_util::backends;
use strata::gguf::{GgmlType, GgufFile, GgufWriter};
use strata::storage::{AlignedBuf, AlignedWindow, ExtentReader, ReadRequest, Reader};

#[test]
fn unaligned_gguf_tensors_stream_with_an_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unaligned.gguf");
    let mut w = GgufWriter::new(32);
    let shapes: [&[u64]; 5] = [&[37], &[1000, 3], &[5], &[4096, 2], &[333, 7]];
    for (i, ne) in shapes.iter().enumerate() {
        let n: u64 = ne.iter().product();
        let data: Vec<u8> = (0..n)
            .flat_map(|j| ((i as f32) * 1000.0 + j as f32).to_le_bytes())
            .collect();
        w.add_tensor(&format!("t{i}"), ne, GgmlType::F32, data)
            .unwrap();
    }
    w.write_file(&path).unwrap();
    let file = std::fs::read(&path).unwrap();
    let gguf = GgufFile::open(&path).unwrap();
    assert!(
        gguf.tensors.iter().any(|t| t.offset % 4096 != 0),
        "the test wants unaligned tensors"
    );

    for backend in backends(&path) {
        let cfg = strata::storage::ReaderConfig {
            backend,
            chunk_size: 8192,
            ..storage_util::small_cfg(backend)
        };
        let r = Reader::open(&path, cfg).unwrap();
        // All tensors in one submission, windows packed into one buffer.
        let mut reqs = Vec::new();
        let mut at = 0usize;
        for t in &gguf.tensors {
            reqs.push(ReadRequest {
                file_offset: t.offset,
                len: t.size,
                buf_offset: at,
            });
            at += AlignedWindow::covering(t.offset, t.size).unwrap().len as usize;
        }
        let done = r.submit(AlignedBuf::new(at).unwrap(), &reqs).unwrap();
        let done = done.wait().unwrap();
        for (i, t) in gguf.tensors.iter().enumerate() {
            let want = &file[t.offset as usize..(t.offset + t.size) as usize];
            assert!(done.data(i) == want, "{backend:?} {}", t.name);
            let inner = done.data_offset(i) - reqs[i].buf_offset;
            assert_eq!(inner as u64, t.offset % 4096);
        }
    }
}
