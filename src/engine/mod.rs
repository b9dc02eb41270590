//! The engine: builds an [`Engine`] from a model file and a configuration
//! and runs forward steps on it, one layer-group graph at a time, while the
//! pager streams the weights and KV blocks the memory plan keeps off the
//! device. Each file is one job:
//!
//! - `config`: [`EngineConfig`] and its parts (budgets, paging, KV tier);
//! - `load`: [`Engine::load`], from file and configuration to a placed model;
//!   `planning`: what a load asks the memory plan (the machine measured,
//!   the plan's input, GEMM, the host CPU's groups, hot experts);
//! - `probe`: the machine measured at load (copy rate, CPU and device speed);
//! - `state`: the [`Engine`] value, its accessors and KV operations;
//! - `step`: [`Engine::decode`], the forward step; `inputs`: its host-side
//!   inputs (embedding rows, masks);
//! - `batch`: a step's tokens and statistics;
//! - `templates`: the cache of built group graphs and their activations;
//! - `store`, `model_file`, `window`, `cpuweights`: where weights live
//!   (device, pinned host, DRAM window over the file, CPU copies);
//! - `pager`: the slot rings' operations on real streams and events;
//! - `buffers`: the persistent device tensors (residual, step inputs, KV);
//! - `kvcache`, `kvtier`: the KV cache's one owner and its host/SSD tier;
//! - `host`: groups the host CPU computes (hybrid decode); `hops`: the
//!   residual's way down to it and back up by kernels;
//! - `rows`: the row split's step (every device a share of every group,
//!   their outputs summed);
//! - `split`: a mixture's layers whose experts the device and the host
//!   compute together (expert split);
//! - `hot`, `hotpool`: a mixture's most picked experts kept on the device
//!   (their memory), which computes their picks while the host computes
//!   the others';
//! - `lookahead`, `aheadslots`: the next host layer's predicted experts
//!   uploaded over the idle bus while the host computes (their memory),
//!   the device computing the picks they catch;
//! - `session`: KV caches saved to and restored from files;
//! - `timeline`: the recorder behind `bench --trace`.
//!
//! Parts import siblings and lower layers, never this file.

mod aheadslots;
mod batch;
mod buffers;
mod config;
mod cpuweights;
mod error;
mod exchange;
mod halfrows;
mod halves;
mod hops;
pub mod host;
mod hot;
mod hotpool;
mod inputs;
mod inputsup;
mod kvcache;
pub mod kvtier;
mod load;
mod lookahead;
mod model_file;
mod pager;
mod planning;
mod probe;
mod routed;
mod rows;
mod session;
mod split;
mod state;
mod step;
mod store;
mod templates;
pub mod threads;
pub mod timeline;
mod widen;
mod window;

pub use crate::paging::routed::RoutedStats;
pub use crate::paging::{Budgets, ExpertSplit, SplitInput};
pub use batch::{BatchToken, StepStats};
pub use config::{
    default_threads, Amx, DeviceChoice, EngineConfig, Faults, Gemm, Hybrid, KvTierOptions,
    PagingOptions, SplitMode,
};
pub use error::EngineError;
pub use hot::HotRefresh;
pub use kvcache::KvCache;
pub use model_file::{read_router_counts, save_router_counts, ModelFile, COUNTS_MAX_BYTES};
pub use pager::PagerStats;
pub use probe::{measure_h2d, reset_matmul_path};
pub use state::Engine;
pub use store::{GroupLayout, Location, WeightStore};
