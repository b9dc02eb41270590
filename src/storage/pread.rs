//! The pread backend: each worker thread takes a chunk and reads it with
//! blocking `pread` calls until [`Shared::advance`] says it is done or
//! failed. Queue depth = number of threads.

use super::shared::{Shared, Step};
use crossbeam_utils::sync::Parker;
use std::os::unix::io::AsRawFd;
use std::time::Duration;

pub(crate) fn run(sh: &Shared, parker: Parker) {
    let fd = sh.file.file.as_raw_fd();
    loop {
        let Some(mut c) = sh.next_chunk() else {
            if sh.is_stopping() {
                sh.drain();
                return;
            }
            parker.park_timeout(Duration::from_millis(200));
            continue;
        };
        loop {
            if sh.is_stopping() || c.read.is_cancelled() {
                sh.skip(c);
                break;
            }
            c.op = sh.begin_op(false);
            // SAFETY: dst_at_pos..+want lies inside the chunk's window of the
            // buffer owned by `c.read`, alive and written by nobody else
            // until this chunk is finished.
            let n = unsafe {
                libc::pread(
                    fd,
                    c.dst_at_pos().cast(),
                    c.want() as usize,
                    c.pos as libc::off_t,
                )
            };
            let res = if n < 0 {
                -(std::io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO) as i64)
            } else {
                n as i64
            };
            match sh.advance(&mut c, res) {
                Step::Again => continue,
                step => {
                    sh.finish(c, step);
                    break;
                }
            }
        }
    }
}
