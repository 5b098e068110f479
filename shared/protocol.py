"""Wire protocol between the control plane and the data plane: msgpack frames over ZeroMQ.

Every frame is one msgpack array ``[PROTOCOL_VERSION, kind, body]``. Each message below is a
plain dataclass with an explicit ``to_wire`` (a msgpack-able list, fields in a fixed order)
and ``from_wire``; ``encode``/``decode`` wrap them with the version and kind. A frame with an
unknown version or kind, or that does not decode, raises ProtocolError: the receiver logs
and drops it.

Conversation::

    control plane                                   data plane
      HELLO ─────────────────────────────────────────►
      ◄──────────────────────────────────────── HANDSHAKE (model facts, pool sizes)
      STEP_PLAN ─────────────────────────────────────► swap/copy, forward, sample
      ◄─────────────────────────────────────── STEP_RESULT
      PING ──────────────────────────────────────────► (between steps, as a heartbeat)
      ◄──────────────────────────────────────────────── PONG
      SHUTDOWN ──────────────────────────────────────►
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a plan of a whole new batch of long prompts fits easily

HELLO, HANDSHAKE, STEP_PLAN, STEP_RESULT, PING, PONG, SHUTDOWN, ERROR = (
    "hello", "handshake", "plan", "result", "ping", "pong", "shutdown", "error")
KINDS = {HELLO, HANDSHAKE, STEP_PLAN, STEP_RESULT, PING, PONG, SHUTDOWN, ERROR}


class ProtocolError(ValueError):
    """A frame that cannot be accepted: wrong version, unknown kind, malformed body."""


@dataclass
class Handshake:
    model_id: str            # what the data plane loaded (path or name)
    vocab_size: int          # rows of the LM head: token ids must be below this
    num_layers: int          # transformer layers, each with its own K and V cache
    num_kv_heads: int        # KV heads per layer (GQA groups)
    head_dim: int            # size of one head
    dtype: str               # "float32" | "bfloat16" | "float16": model and KV cache dtype
    block_size: int          # tokens per KV block
    num_device_blocks: int   # blocks in the device KV pool (ids 0 .. num_device_blocks-1)
    num_cpu_blocks: int      # blocks in the CPU swap pool (0: no swapping)
    max_model_len: int       # longest sequence (prompt + output) the model accepts
    device: str              # e.g. "cpu" or "cuda:0 (NVIDIA H200)"
    eos_token_ids: list[int] = field(default_factory=list)  # from the model's generation config

    def to_wire(self) -> list:
        return [self.model_id, self.vocab_size, self.num_layers, self.num_kv_heads, self.head_dim,
                self.dtype, self.block_size, self.num_device_blocks, self.num_cpu_blocks,
                self.max_model_len, self.device, list(self.eos_token_ids)]

    @classmethod
    def from_wire(cls, body: list) -> "Handshake":
        return cls(*body)


@dataclass
class SamplingSpec:
    """What the data plane's sampler needs of a request's sampling parameters."""
    temperature: float = 1.0          # 0: greedy (argmax)
    top_k: int = -1                   # -1: all tokens
    top_p: float = 1.0                # nucleus mass kept
    min_p: float = 0.0                # drop tokens below min_p * p(max)
    seed: int | None = None           # per-token generators are derived from it: batch-independent
    presence_penalty: float = 0.0     # subtracted once from logits of tokens already generated
    frequency_penalty: float = 0.0    # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0   # HF-style, over prompt and generated tokens
    min_tokens: int = 0               # ban the stop token ids until this many tokens are generated
    stop_token_ids: list[int] = field(default_factory=list)  # banned while below min_tokens
    logprobs: int = 0                 # how many top log-probabilities to return per token (0: none)
    n: int = 1                        # draws for the first output token (parallel sampling forks after it)
    beam_width: int = 0               # > 0: a beam; the control plane picks and sends each next token
    # per-sequence logits adjustments (OpenAI's logit_bias, vLLM's allowed_token_ids and bad_words)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)   # (token id, added to its logit)
    allowed_token_ids: list[int] = field(default_factory=list)          # non-empty: only these
    bad_words_ids: list[list[int]] = field(default_factory=list)        # last token banned after the rest

    def to_wire(self) -> list:
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.presence_penalty,
                self.frequency_penalty, self.repetition_penalty, self.min_tokens,
                list(self.stop_token_ids), self.logprobs, self.n, self.beam_width,
                [list(b) for b in self.logit_bias], list(self.allowed_token_ids),
                [list(w) for w in self.bad_words_ids]]

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_ids)

    @classmethod
    def from_wire(cls, body: list) -> "SamplingSpec":
        return cls(*body)


@dataclass
class NewSequence:
    """A sequence the data plane has not seen (or forgot): sent once, in full."""
    seq_id: int               # unique for the life of the control plane
    token_ids: list[int]      # every known token: prompt, plus outputs when recomputing
    num_prompt_tokens: int    # token_ids[:num_prompt_tokens] is the prompt (for penalties)
    num_computed_tokens: int  # tokens whose KV already sits in the blocks (prefix cache)
    num_new_tokens: int       # tokens to compute this step, from num_computed_tokens on
    block_ids: list[int]      # the whole block table
    sampling: SamplingSpec

    def to_wire(self) -> list:
        return [self.seq_id, self.token_ids, self.num_prompt_tokens, self.num_computed_tokens,
                self.num_new_tokens, self.block_ids, self.sampling.to_wire()]

    @classmethod
    def from_wire(cls, body: list) -> "NewSequence":
        *head, sampling = body
        return cls(*head, SamplingSpec.from_wire(sampling))


@dataclass
class StepPlan:
    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    # Sequences the data plane knows, as deltas: (seq_id, num_new_tokens, appended block ids,
    # appended token ids). For a decode step the one new token is the last one the data plane
    # sampled, and no token is sent; a beam's next token is chosen here and sent.
    cont_seqs: list[tuple[int, int, list[int], list[int]]] = field(default_factory=list)
    forget_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)    # (src device block, dst device block)
    # Replacements of block-table entries after copy-on-write: (seq_id, logical index, new block id)
    remaps: list[tuple[int, int, int]] = field(default_factory=list)
    # Structured output: (seq_id, packed bitmask of the tokens it may sample this step), only for
    # constrained sequences that sample this step; little-endian bits, ceil(vocab / 32) * 4 bytes
    token_masks: list[tuple[int, bytes]] = field(default_factory=list)

    def to_wire(self) -> list:
        return [self.step_id, [s.to_wire() for s in self.new_seqs], self.cont_seqs, self.forget_seq_ids,
                self.swap_out, self.swap_in, self.copies, self.remaps, self.token_masks]

    @classmethod
    def from_wire(cls, body: list) -> "StepPlan":
        step_id, new, cont, forget, swap_out, swap_in, copies, remaps, masks = body
        return cls(step_id, [NewSequence.from_wire(s) for s in new],
                   [(int(a), int(b), list(c), list(d)) for a, b, c, d in cont], list(forget),
                   [tuple(p) for p in swap_out], [tuple(p) for p in swap_in],
                   [tuple(p) for p in copies], [tuple(r) for r in remaps],
                   [(int(i), bytes(m)) for i, m in masks])


def draw_seed(seed: int | None, draw: int) -> int | None:
    """Seed of the draw-th parallel sample of a seeded request (draw 0 keeps the request's seed)."""
    if seed is None or draw == 0:
        return seed
    return (seed * 6364136223846793005 + draw * 1442695040888963407) & ((1 << 63) - 1)


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float                                   # log-probability of token_id (after processing)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # when asked for

    def to_wire(self) -> list:
        return [self.seq_id, self.token_id, self.logprob, self.top_logprobs]

    @classmethod
    def from_wire(cls, body: list) -> "SampledToken":
        seq_id, token_id, logprob, top = body
        return cls(seq_id, token_id, logprob, [tuple(t) for t in top])


@dataclass
class StepResult:
    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)  # sequences that finished their prompt
    num_tokens: int = 0             # tokens computed in the forward pass
    forward_seconds: float = 0.0    # model forward + sampling
    swap_seconds: float = 0.0       # swap and copy orders before the forward
    error: str | None = None        # the step failed as a whole; nothing was sampled

    def to_wire(self) -> list:
        return [self.step_id, [s.to_wire() for s in self.sampled], self.num_tokens,
                self.forward_seconds, self.swap_seconds, self.error]

    @classmethod
    def from_wire(cls, body: list) -> "StepResult":
        step_id, sampled, *rest = body
        return cls(step_id, [SampledToken.from_wire(s) for s in sampled], *rest)


_BODY_TYPES = {HANDSHAKE: Handshake, STEP_PLAN: StepPlan, STEP_RESULT: StepResult}


def encode(kind: str, message=None) -> bytes:
    """One frame. `message` is a dataclass above, or a plain msgpack-able value (ERROR: a string)."""
    assert kind in KINDS, f"unknown kind {kind!r}"
    body = message.to_wire() if hasattr(message, "to_wire") else message
    return msgpack.packb([PROTOCOL_VERSION, kind, body], use_bin_type=True)


def decode(frame: bytes):
    """(kind, message) of a frame; raises ProtocolError for anything that is not a valid frame."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES} limit")
    try:
        version, kind, body = msgpack.unpackb(frame, raw=False, strict_map_key=True,
                                              max_bin_len=MAX_FRAME_BYTES, max_str_len=MAX_FRAME_BYTES)
    except Exception as exc:  # msgpack raises several types; all mean the same to us
        raise ProtocolError(f"undecodable frame: {exc}") from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    body_type = _BODY_TYPES.get(kind)
    if body_type is None:
        return kind, body
    try:
        return kind, body_type.from_wire(body)
    except Exception as exc:
        raise ProtocolError(f"malformed {kind} body: {exc}") from None
