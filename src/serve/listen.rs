//! The accept loop: HTTP/1.1 connections served by hyper with the limits a
//! public endpoint needs (axum's own `serve` sets none): a connection must
//! send a request's headers within `header_timeout` of being ready for
//! one, which closes slowloris connections and idle keep-alive ones alike
//! (hyper's `header_read_timeout` starts when it waits for a head); at most
//! `max_connections` are open, more are closed at once. On `stop` it stops
//! accepting, closes idle and half-sent connections, and lets requests in
//! progress end (the engine loop's grace period bounds them) for at most
//! `drain` before returning.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The connection limits.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    /// Time a connection has to send a request's headers, from when it
    /// is ready for one (connect, or the end of the previous answer).
    pub header_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Time running requests get after `stop` before the loop returns.
    pub drain: Duration,
}

/// Serves `app` on `listener` until `stop` completes, then drains.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stop: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    tokio::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // out of descriptors or the like: wait instead of spinning
                    eprintln!("strata serve: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // over the cap: closed unanswered
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    // idle connections close now; those mid-request finish their answer
    if tokio::time::timeout(limits.drain, graceful.shutdown())
        .await
        .is_err()
    {
        eprintln!(
            "strata serve: connections still open after {:.0} s; closing",
            limits.drain.as_secs_f64()
        );
    }
}
