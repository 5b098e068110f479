"""Wire protocol between the control plane and the data plane: msgpack frames over ZeroMQ.

Every frame is one msgpack array ``[PROTOCOL_VERSION, kind, body]``. Each message below is a
plain dataclass with an explicit ``to_wire`` (a msgpack-able list, fields in a fixed order)
and ``from_wire``; ``encode``/``decode`` wrap them with the version and kind. A frame with an
unknown version or kind, or that does not decode, raises ProtocolError: the receiver logs
and drops it. `decode` accepts any bytes: every body is checked for shape and types here, so
that a hostile or garbled frame never reaches code that trusts it.

Ownership: a data plane serves one control plane. The first HELLO makes its sender the owner,
and the HANDSHAKE carries the owner's token; the owner says HELLO with that token when it
reconnects (a new socket). Anyone else gets an ERROR refusal while the owner's link is up.

Conversation::

    control plane                                   data plane
      HELLO (owner token, if it has one) ────────────►
      ◄──────────────────── HANDSHAKE (model facts, pool sizes, owner token) or ERROR (refused)
      STEP_PLAN ─────────────────────────────────────► swap/copy, forward, sample
      ◄─────────────────────────────────────── STEP_RESULT
      PING ──────────────────────────────────────────► (between steps, as a heartbeat)
      ◄──────────────────────────────────────────────── PONG
      SHUTDOWN ──────────────────────────────────────►
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

PROTOCOL_VERSION = 2   # 2: cached sequences as CachedSequence, remaps inside them
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a plan of a whole new batch of long prompts fits easily

# a block-table entry whose block left the sliding window and went back to the pool: it keeps the
# logical index of the blocks after it, and nothing reads it (see control_plane/block_manager.py)
FREED_BLOCK_ID = -1
# a sequence of a model without state layers holds no slot of the state pool
NO_STATE_SLOT = -1

HELLO, HANDSHAKE, STEP_PLAN, STEP_RESULT, PING, PONG, SHUTDOWN, ERROR = (
    "hello", "handshake", "plan", "result", "ping", "pong", "shutdown", "error")
KINDS = {HELLO, HANDSHAKE, STEP_PLAN, STEP_RESULT, PING, PONG, SHUTDOWN, ERROR}


class ProtocolError(ValueError):
    """A frame that cannot be accepted: wrong version, unknown kind, malformed body."""


_INT64 = (-(2**63), 2**63 - 1)


def _int(x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not _INT64[0] <= x <= _INT64[1]:
        raise ProtocolError(f"expected a 64-bit integer, got {type(x).__name__}")
    return x


def _opt_int(x) -> int | None:
    return None if x is None else _int(x)


def _float(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ProtocolError(f"expected a number, got {type(x).__name__}")
    return float(x)


def _str(x) -> str:
    if not isinstance(x, str):
        raise ProtocolError(f"expected a string, got {type(x).__name__}")
    return x


def _list(x, n: int | None = None) -> list:
    if not isinstance(x, (list, tuple)) or (n is not None and len(x) != n):
        raise ProtocolError(f"expected a list{'' if n is None else f' of {n}'}, got {type(x).__name__}")
    return list(x)


def _ints(x) -> list[int]:
    return [_int(v) for v in _list(x)]


def _int_tuples(x, n: int) -> list[tuple]:
    return [tuple(_int(v) for v in _list(t, n)) for t in _list(x)]


@dataclass
class Hello:
    token: str | None = None   # the owner token of an earlier handshake: "it is me again"

    def to_wire(self) -> list:
        return [self.token]

    @classmethod
    def from_wire(cls, body) -> "Hello":
        if body is None:
            return cls()
        (token,) = _list(body, 1)
        return cls(None if token is None else _str(token))


@dataclass
class Handshake:
    model_id: str            # what the data plane loaded (path or name)
    vocab_size: int          # rows of the LM head: token ids must be below this
    num_layers: int          # K/V slabs of a block: the attention layers (a state layer has none; 0 for
                             # Mamba), or one group's with layer groups, so block bytes computed from it
                             # are the pool's
    num_kv_heads: int        # KV heads per layer (GQA groups)
    head_dim: int            # size of one head
    dtype: str               # "float32" | "bfloat16" | "float16": model and KV cache dtype
    block_size: int          # tokens per KV block
    num_device_blocks: int   # blocks in the device KV pool (ids 0 .. num_device_blocks-1)
    num_cpu_blocks: int      # blocks in the CPU swap pool (0: no swapping)
    max_model_len: int       # longest sequence (prompt + output) the model accepts
    device: str              # e.g. "cpu" or "cuda:0 (NVIDIA H200)"
    eos_token_ids: list[int] = field(default_factory=list)  # from the model's generation config
    owner_token: str = ""    # proves ownership when the owner says HELLO again
    # every layer attends to at most this many positions, its own included: blocks wholly before
    # the window of a sequence's next query are never read again and may be freed. 0: some layer
    # sees the whole context: nothing is freed
    sliding_window: int = 0
    # slots of the state pool (data_plane/state_pool.py), one per running sequence, for a model whose
    # layers keep a per-sequence state (LFM2's convolutions); 0: no such layer, every sequence needs
    # blocks only
    num_state_slots: int = 0
    # layer groups, each with a block table of its own per sequence (data_plane/kv_pool.py): per group, the
    # positions its layers read back (0: all). Empty: one group, whose reach is `sliding_window`
    group_reaches: list[int] = field(default_factory=list)

    def to_wire(self) -> list:
        return [self.model_id, self.vocab_size, self.num_layers, self.num_kv_heads, self.head_dim,
                self.dtype, self.block_size, self.num_device_blocks, self.num_cpu_blocks,
                self.max_model_len, self.device, list(self.eos_token_ids), self.owner_token,
                self.sliding_window, self.num_state_slots, list(self.group_reaches)]

    @classmethod
    def from_wire(cls, body: list) -> "Handshake":
        b = _list(body)
        if len(b) != 16:   # both planes ship in one package: every field is always sent
            raise ProtocolError(f"a handshake has 16 fields, got {len(b)}")
        window, slots, reaches = _int(b[13]), _int(b[14]), _ints(b[15])
        if window < 0 or any(r < 0 for r in reaches):
            raise ProtocolError(f"a handshake's sliding window and group reaches must be >= 0, got {window}, "
                                f"{reaches}")
        if reaches and window:
            raise ProtocolError("a handshake with layer groups gives each group's reach, not one sliding window")
        if len(reaches) == 1:
            raise ProtocolError("a handshake's group reaches list two groups or more (one group: sliding_window)")
        if slots < 0:
            raise ProtocolError(f"a handshake's state slots must be >= 0, got {slots}")
        return cls(_str(b[0]), *(_int(v) for v in b[1:5]), _str(b[5]), *(_int(v) for v in b[6:10]),
                   _str(b[10]), _ints(b[11]), _str(b[12]), window, slots, reaches)


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
    # how many top log-probabilities to return per token; 0: only the chosen token's; -1: not even
    # that (its SampledToken.logprob may then be NaN: a greedy row may skip most logits, ops/greedy_head.py)
    logprobs: int = 0
    n: int = 1                        # draws for the first output token (parallel sampling forks after it)
    beam_width: int = 0               # > 0: a beam; the control plane picks and sends each next token
    # per-sequence logits adjustments (OpenAI's logit_bias, vLLM's allowed_token_ids and bad_words)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)   # (token id, added to its logit)
    allowed_token_ids: list[int] = field(default_factory=list)          # non-empty: only these
    bad_words_ids: list[list[int]] = field(default_factory=list)        # last token banned after the rest
    # None: no prompt log-probs; k >= 0: each prompt token's log-prob under the raw model distribution
    # (data_plane/prompt_logprobs.py) and its k most likely alternatives
    prompt_logprobs: int | None = None

    def to_wire(self) -> list:
        # the logits adjustments and prompt_logprobs are optional trailing fields: absent while unused
        fields = [self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.presence_penalty,
                  self.frequency_penalty, self.repetition_penalty, self.min_tokens,
                  list(self.stop_token_ids), self.logprobs, self.n, self.beam_width,
                  [list(b) for b in self.logit_bias], list(self.allowed_token_ids),
                  [list(w) for w in self.bad_words_ids]]
        # prompt_logprobs 0 is falsy but asked for: it is appended after the (then untrimmed) adjustments
        return _trim(fields, 3) if self.prompt_logprobs is None else fields + [self.prompt_logprobs]

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_ids)

    @classmethod
    def from_wire(cls, body: list) -> "SamplingSpec":
        b = _list(body)
        if not 13 <= len(b) <= 17:
            raise ProtocolError(f"a sampling spec has 13 to 17 fields, got {len(b)}")
        (temperature, top_k, top_p, min_p, seed, presence, frequency, repetition, min_tokens, stop_ids,
         logprobs, n, beam_width, bias, allowed, bad) = (b + [[]] * (16 - len(b)))[:16]
        prompt_logprobs = _opt_int(b[16]) if len(b) == 17 else None
        if prompt_logprobs is not None and prompt_logprobs < 0:
            raise ProtocolError(f"prompt_logprobs must be None or >= 0, got {prompt_logprobs}")
        logprobs = _int(logprobs)
        if logprobs < -1:
            raise ProtocolError(f"logprobs must be -1 (none used) or >= 0, got {logprobs}")
        return cls(_float(temperature), _int(top_k), _float(top_p), _float(min_p), _opt_int(seed), _float(presence),
                   _float(frequency), _float(repetition), _int(min_tokens), _ints(stop_ids), logprobs, _int(n),
                   _int(beam_width), [(_int(t), _float(v)) for t, v in (_list(p, 2) for p in _list(bias))],
                   _ints(allowed), [_ints(w) for w in _list(bad)], prompt_logprobs)


def _trim(fields: list, num_optional: int) -> list:
    """Drops the trailing optional fields that are empty (each has a falsy default), so that an
    optional field added at the end costs nothing on the wire while unused."""
    while num_optional and not fields[-1]:
        fields.pop()
        num_optional -= 1
    return fields


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
    # its slot of the state pool (a model with state layers; see Handshake.num_state_slots), -1: none.
    # Optional at the end of the wire list: absent for a model without state layers
    state_slot: int = NO_STATE_SLOT

    def to_wire(self) -> list:
        fields = [self.seq_id, self.token_ids, self.num_prompt_tokens, self.num_computed_tokens,
                  self.num_new_tokens, self.block_ids, self.sampling.to_wire()]
        return fields if self.state_slot == NO_STATE_SLOT else fields + [self.state_slot]

    @classmethod
    def from_wire(cls, body: list) -> "NewSequence":
        b = _list(body)
        if len(b) not in (7, 8):
            raise ProtocolError(f"a new sequence has 7 or 8 fields, got {len(b)}")
        seq_id, token_ids, num_prompt, num_computed, num_new, block_ids, sampling = b[:7]
        slot = _int(b[7]) if len(b) == 8 else NO_STATE_SLOT
        if slot < 0 and slot != NO_STATE_SLOT:
            raise ProtocolError(f"a state slot must be >= 0, got {slot}")
        return cls(_int(seq_id), _ints(token_ids), _int(num_prompt), _int(num_computed), _int(num_new),
                   _ints(block_ids), SamplingSpec.from_wire(sampling), slot)


@dataclass
class CachedSequence:
    """A sequence the data plane knows (sent before as a NewSequence): only what changed. A decode
    step of a sampled sequence is [seq_id, 1] on the wire: its one new token is the one the data
    plane sampled for it last step and appended itself. New optional fields go at the end, with a
    falsy default, and cost nothing while unused."""
    seq_id: int
    num_new_tokens: int                                        # tokens to compute this step
    new_block_ids: list[int] = field(default_factory=list)     # appended to its block table
    new_token_ids: list[int] = field(default_factory=list)     # appended to its tokens (a beam's
                                                               # next token, chosen by the control plane)
    remaps: list[tuple[int, int]] = field(default_factory=list)  # (table index, new block id): the
                                                               # entry replaced by its copy-on-write copy

    def to_wire(self) -> list:
        return _trim([self.seq_id, self.num_new_tokens, self.new_block_ids, self.new_token_ids, self.remaps], 3)

    @classmethod
    def from_wire(cls, body: list) -> "CachedSequence":
        b = _list(body)
        if not 2 <= len(b) <= 5:
            raise ProtocolError(f"a cached sequence has 2 to 5 fields, got {len(b)}")
        seq_id, num_new, blocks, tokens, remaps = b + [[]] * (5 - len(b))
        return cls(_int(seq_id), _int(num_new), _ints(blocks), _ints(tokens), _int_tuples(remaps, 2))


@dataclass
class StepPlan:
    """One step, as the control plane decided it. The data plane applies, in this order: forget,
    the new and cached sequences' table changes, swap-out, swap-in, copies; then one forward over
    the scheduled tokens (new sequences first, then cached ones, in list order)."""
    step_id: int                                                   # the result answers with it
    new_seqs: list[NewSequence] = field(default_factory=list)      # scheduled, sent in full
    cached_seqs: list[CachedSequence] = field(default_factory=list)  # scheduled, sent as deltas
    forget_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)    # (src device block, dst device block)
    # Structured output: (seq_id, packed bitmask of the tokens it may sample this step), only for
    # constrained sequences that sample this step; little-endian bits, ceil(vocab / 32) * 4 bytes.
    # Optional at the end of the wire list: absent while no sequence is constrained.
    token_masks: list[tuple[int, bytes]] = field(default_factory=list)
    # (src slot, dst slot) of the state pool: a fork's child starts from its parent's state, copied
    # before the forward. Optional at the end: absent without forks of a model with state layers
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # state slots moved with a swapped sequence's blocks: (device slot, CPU slot) out, (CPU slot, device
    # slot) in; run after the state copies, out before in. Optional at the end, like the copies
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)

    def to_wire(self) -> list:
        return _trim([self.step_id, [s.to_wire() for s in self.new_seqs], [s.to_wire() for s in self.cached_seqs],
                      self.forget_seq_ids, self.swap_out, self.swap_in, self.copies,
                      [[i, m] for i, m in self.token_masks], self.state_copies, self.state_swap_out,
                      self.state_swap_in], 4)

    @classmethod
    def from_wire(cls, body: list) -> "StepPlan":
        b = _list(body)
        if not 7 <= len(b) <= 11:
            raise ProtocolError(f"a step plan has 7 to 11 fields, got {len(b)}")
        step_id, new, cached, forget, swap_out, swap_in, copies = b[:7]
        masks = []
        for item in (_list(b[7]) if len(b) >= 8 else []):
            seq_id, mask = _list(item, 2)
            if not isinstance(mask, bytes):
                raise ProtocolError("a token mask must be bytes")
            masks.append((_int(seq_id), mask))
        return cls(_int(step_id), [NewSequence.from_wire(s) for s in _list(new)],
                   [CachedSequence.from_wire(s) for s in _list(cached)], _ints(forget), _int_tuples(swap_out, 2),
                   _int_tuples(swap_in, 2), _int_tuples(copies, 2), masks,
                   *(_int_tuples(b[i], 2) if len(b) > i else [] for i in (8, 9, 10)))


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
        seq_id, token_id, logprob, top = _list(body, 4)
        return cls(_int(seq_id), _int(token_id), _float(logprob),
                   [(_int(i), _float(lp)) for i, lp in (_list(t, 2) for t in _list(top))])


@dataclass
class PromptLogprobs:
    """Log-probs of a run of one sequence's prompt tokens, computed this step: entry i is about prompt
    token first_position + i given the tokens before it (position 0 has none and is never sent)."""
    seq_id: int
    first_position: int                 # >= 1
    logprobs: list[float]               # of each prompt token
    ranks: list[int]                    # 1 + how many tokens were more likely than it
    top: list[list[tuple[int, float]]] = field(default_factory=list)   # per token, when k > 0: k best

    def to_wire(self) -> list:
        return [self.seq_id, self.first_position, self.logprobs, self.ranks, [list(map(list, t)) for t in self.top]]

    @classmethod
    def from_wire(cls, body: list) -> "PromptLogprobs":
        seq_id, first, logprobs, ranks, top = _list(body, 5)
        out = cls(_int(seq_id), _int(first), [_float(v) for v in _list(logprobs)], _ints(ranks),
                  [[(_int(i), _float(lp)) for i, lp in (_list(p, 2) for p in _list(t))] for t in _list(top)])
        if out.first_position < 1 or len(out.ranks) != len(out.logprobs) or out.top and len(out.top) != len(out.ranks):
            raise ProtocolError("prompt log-probs of inconsistent lengths or position")
        return out


@dataclass
class StepResult:
    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)  # sequences that finished their prompt
    num_tokens: int = 0             # tokens computed in the forward pass
    forward_seconds: float = 0.0    # model forward + sampling
    swap_seconds: float = 0.0       # swap and copy orders before the forward
    error: str | None = None        # the step failed as a whole; nothing was sampled
    # sequences that asked for prompt log-probs: those of the prompt tokens this step computed.
    # Optional at the end of the wire list: absent while no sequence asks.
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    def to_wire(self) -> list:
        return _trim([self.step_id, [s.to_wire() for s in self.sampled], self.num_tokens,
                      self.forward_seconds, self.swap_seconds, self.error,
                      [p.to_wire() for p in self.prompt_logprobs]], 1)

    @classmethod
    def from_wire(cls, body: list) -> "StepResult":
        b = _list(body)
        if len(b) not in (6, 7):
            raise ProtocolError(f"a step result has 6 or 7 fields, got {len(b)}")
        step_id, sampled, num_tokens, forward_seconds, swap_seconds, error = b[:6]
        return cls(_int(step_id), [SampledToken.from_wire(s) for s in _list(sampled)], _int(num_tokens),
                   _float(forward_seconds), _float(swap_seconds), None if error is None else _str(error),
                   [PromptLogprobs.from_wire(p) for p in (_list(b[6]) if len(b) == 7 else [])])


def _no_body(body) -> None:
    if body is not None:
        raise ProtocolError("this kind of frame has no body")


def _error_text(body) -> str:
    return _str(body)[:4096]


# how each kind's body is read; every reader raises on a body of the wrong shape or types
_BODY_TYPES = {HELLO: Hello.from_wire, HANDSHAKE: Handshake.from_wire, STEP_PLAN: StepPlan.from_wire,
               STEP_RESULT: StepResult.from_wire, PING: _no_body, PONG: _no_body, SHUTDOWN: _no_body,
               ERROR: _error_text}


def encode(kind: str, message=None) -> bytes:
    """One frame. `message` is a dataclass above, or a plain msgpack-able value (ERROR: a string)."""
    assert kind in KINDS, f"unknown kind {kind!r}"
    body = message.to_wire() if hasattr(message, "to_wire") else message
    return msgpack.packb([PROTOCOL_VERSION, kind, body], use_bin_type=True)


def _show(value) -> str:
    """A short description of a hostile value for a log line (never its full repr)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def decode(frame) -> tuple:
    """(kind, message) of a frame; raises ProtocolError, and nothing else, for anything that is not
    a valid frame: any bytes, any msgpack value of any shape."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame is bytes, not {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES} limit")
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                                max_bin_len=MAX_FRAME_BYTES, max_str_len=MAX_FRAME_BYTES)
    except Exception as exc:  # msgpack raises several types; all mean the same to us
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None
    if not isinstance(value, list) or len(value) != 3:
        raise ProtocolError(f"a frame is [version, kind, body], got {_show(value)}")
    version, kind, body = value
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {_show(version)}, expected {PROTOCOL_VERSION}")
    if not isinstance(kind, str) or kind not in KINDS:   # a list or dict kind is not even hashable
        raise ProtocolError(f"unknown message kind {_show(kind)}")
    try:
        return kind, _BODY_TYPES[kind](body)
    except ProtocolError as exc:
        raise ProtocolError(f"malformed {kind} body: {exc}") from None
    except Exception as exc:   # an unpacking of the wrong length, and the like
        raise ProtocolError(f"malformed {kind} body: {type(exc).__name__}: {exc}") from None
