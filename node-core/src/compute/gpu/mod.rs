//! The wgpu backend: the shard products as WGSL kernels, one code path for native GPUs (Vulkan,
//! Metal, DX12) and for WebGPU in the browser. The CPU kernels are the reference it is tested
//! against (node-core/tests/gpu.rs).
//!
//! Weights are uploaded once ([`GpuMatrix`]) and stay resident; a product moves only its
//! inputs and outputs. Matrices larger than the adapter's storage binding limit are split by
//! rows into chunks, each its own buffer and dispatch.

pub(crate) mod kernels;
pub(crate) mod matrix;

use std::fmt;

pub use matrix::{GpuMatrix, Placement, Weights};

use kernels::Kernels;

/// Errors of the GPU backend.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No adapter was found, or none that fits the request.
    #[error("no GPU adapter: {0}")]
    NoAdapter(String),
    /// The adapter refused a device.
    #[error("GPU device: {0}")]
    Device(String),
    /// Reading results back failed.
    #[error("GPU readback: {0}")]
    Readback(String),
    /// Inputs that do not fit the matrices.
    #[error("GPU product: {0}")]
    Shape(String),
}

/// Where a node computes, as chosen on the command line (`--device cpu|gpu|auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The CPU kernels.
    #[default]
    Cpu,
    /// A wgpu adapter, any kind (a software one too); fails when there is none.
    Gpu,
    /// A hardware wgpu adapter when there is one, else the CPU.
    Auto,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "gpu" => Ok(Self::Gpu),
            "auto" => Ok(Self::Auto),
            other => Err(format!("unknown device {other:?} (cpu, gpu or auto)")),
        }
    }
}

/// What a user sees of the adapter in use.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    /// The adapter's name, e.g. "NVIDIA H100 80GB HBM3" or "llvmpipe".
    pub name: String,
    /// The graphics API: Vulkan, Metal, Dx12, BrowserWebGpu.
    pub backend: String,
    /// Discrete, integrated, virtual or CPU (software).
    pub device_type: String,
    /// Driver name and version, where the backend says.
    pub driver: String,
    /// Largest storage buffer binding in bytes (larger matrices are split).
    pub max_binding: u64,
}

impl fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {}, driver {:?}, bindings up to {} MiB)",
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            self.max_binding >> 20
        )
    }
}

/// A wgpu device with the kernels compiled, ready for resident matrices.
#[derive(Debug)]
pub struct Gpu {
    pub(crate) device: wgpu::Device,
    pub(crate) queue: wgpu::Queue,
    info: GpuInfo,
    pub(crate) max_binding: u64,
    /// Largest matrix chunk (the binding limit unless a test lowers it).
    chunk_bytes: u64,
    /// Chunks of at most this many rows run one-token products one row a workgroup.
    narrow_rows: u32,
    pub(crate) kernels: Kernels,
    scratch: futures::lock::Mutex<kernels::Scratch>,
}

impl Gpu {
    /// Opens the best adapter; with `hardware_only`, a software (CPU) adapter counts as none.
    pub async fn open(hardware_only: bool) -> Result<Self, GpuError> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                force_fallback_adapter: false,
                compatible_surface: None,
            })
            .await
            .map_err(|e| GpuError::NoAdapter(e.to_string()))?;
        let a = adapter.get_info();
        if hardware_only && a.device_type == wgpu::DeviceType::Cpu {
            return Err(GpuError::NoAdapter(format!(
                "only a software adapter ({}, {:?})",
                a.name, a.backend
            )));
        }
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("codedmesh"),
                required_features: wgpu::Features::empty(),
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| GpuError::Device(e.to_string()))?;
        let max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let info = GpuInfo {
            name: a.name,
            backend: format!("{:?}", a.backend),
            device_type: format!("{:?}", a.device_type),
            driver: [a.driver, a.driver_info]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" "),
            max_binding,
        };
        tracing::info!(adapter = %info, "GPU opened");
        let kernels = Kernels::new(&device);
        Ok(Self {
            device,
            queue,
            info,
            max_binding,
            chunk_bytes: max_binding,
            // A software adapter runs a workgroup on a CPU thread: more of them only cost.
            narrow_rows: if a.device_type == wgpu::DeviceType::Cpu {
                0
            } else {
                kernels::NARROW_MAX_ROWS
            },
            kernels,
            scratch: Default::default(),
        })
    }

    /// Opens a device for `choice`: `None` for the CPU (chosen, or `auto` without hardware).
    pub async fn for_choice(choice: DeviceChoice) -> Result<Option<Self>, GpuError> {
        match choice {
            DeviceChoice::Cpu => Ok(None),
            DeviceChoice::Gpu => Self::open(false).await.map(Some),
            DeviceChoice::Auto => match Self::open(true).await {
                Ok(gpu) => Ok(Some(gpu)),
                Err(e) => {
                    tracing::info!("no GPU, computing on the CPU: {e}");
                    Ok(None)
                }
            },
        }
    }

    /// The adapter in use.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Splits matrices into chunks of at most `bytes` (at least one row each) instead of the
    /// adapter's binding limit: tests exercise the split on small shapes with it.
    pub fn limit_chunk(&mut self, bytes: u64) {
        self.chunk_bytes = self.chunk_bytes.min(bytes);
    }

    /// Runs one-token products of chunks of at most `rows` rows one row a workgroup (0:
    /// none) instead of the adapter's default: tests check both kernels on any adapter.
    pub fn narrow_rows_up_to(&mut self, rows: u32) {
        self.narrow_rows = rows;
    }

    /// Waits for all submitted work (native; WebGPU polls by itself).
    fn wait(&self) -> Result<(), GpuError> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        Ok(())
    }
}
