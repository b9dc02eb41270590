//! `strata rpc-server`: this machine's devices offered through ggml's own
//! RPC server (the protocol llama.cpp's rpc-server speaks), for `--rpc` on
//! another strata or llama.cpp.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use std::net::IpAddr;
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
pub enum ServedDevices {
    /// The local GPUs if there are any, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

#[derive(Args)]
pub struct RpcServerArgs {
    /// Address to listen on. Anything but a loopback address needs
    /// --allow-remote: the protocol has no authentication.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[arg(long, default_value_t = 50052)]
    port: u16,
    /// Which devices to offer.
    #[arg(long, value_enum, default_value_t = ServedDevices::Auto)]
    device: ServedDevices,
    /// CPU threads of a CPU device (default: the physical cores).
    #[arg(short = 't', long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Keep tensors clients send in this directory, so a client that
    /// loads the same model again need not send them again.
    #[arg(long = "cache-dir")]
    cache_dir: Option<PathBuf>,
    /// Listen on a non-loopback address. Whoever reaches the port can run
    /// computations on the devices and read and write their memory.
    #[arg(long = "allow-remote")]
    allow_remote: bool,
}

/// Refuses a non-loopback address unless remote clients are allowed.
fn check_host(host: IpAddr, allow_remote: bool) -> Result<()> {
    if !host.is_loopback() && !allow_remote {
        bail!(
            "--host {host} is reachable from other machines, and ggml's RPC protocol has no \
             authentication (whoever reaches the port can use the devices and read their \
             memory); pass --allow-remote to listen there anyway, on a trusted network only"
        );
    }
    Ok(())
}

pub fn serve(a: RpcServerArgs) -> Result<()> {
    check_host(a.host, a.allow_remote)?;
    let all = strata::ggml::devices()?;
    let local_gpus: Vec<_> = all
        .iter()
        .copied()
        .filter(|d| d.is_gpu() && !d.is_remote())
        .collect();
    let devices = match a.device {
        ServedDevices::Gpu if local_gpus.is_empty() => bail!("--device gpu: no GPU is loaded"),
        ServedDevices::Gpu => local_gpus,
        ServedDevices::Auto if !local_gpus.is_empty() => local_gpus,
        ServedDevices::Auto | ServedDevices::Cpu => vec![strata::ggml::cpu_device()?],
    };
    if let Some(d) = &a.cache_dir {
        std::fs::create_dir_all(d)
            .map_err(|e| anyhow::anyhow!("--cache-dir {}: {e}", d.display()))?;
    }
    let endpoint = match a.host {
        IpAddr::V6(h) => format!("[{h}]:{}", a.port),
        IpAddr::V4(h) => format!("{h}:{}", a.port),
    };
    if !a.host.is_loopback() {
        eprintln!(
            "warning: serving on {endpoint} without authentication: anyone who reaches it can \
             use these devices"
        );
    }
    for d in &devices {
        let (free, total) = d.memory();
        eprintln!(
            "strata rpc-server: {} ({}, {} MiB, {} MiB free) on {endpoint}",
            d.name(),
            d.description(),
            total >> 20,
            free >> 20
        );
    }
    let threads = a.threads.map_or_else(
        || strata::engine::EngineConfig::default().n_threads,
        |t| t as usize,
    );
    strata::ggml::rpc::serve(&endpoint, &devices, threads, a.cache_dir.as_deref())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_without_allow_remote() {
        assert!(check_host("127.0.0.1".parse().unwrap(), false).is_ok());
        assert!(check_host("::1".parse().unwrap(), false).is_ok());
        let e = check_host("0.0.0.0".parse().unwrap(), false).unwrap_err();
        assert!(e.to_string().contains("--allow-remote"), "{e}");
        assert!(check_host("192.168.1.5".parse().unwrap(), true).is_ok());
    }
}
