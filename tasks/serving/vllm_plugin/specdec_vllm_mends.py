"""specdec-rollout's mends of vLLM's CPU build, loaded as a vLLM general plugin.

vLLM runs every function of the `vllm.general_plugins` entry-point group in each process it
starts (the OpenAI server, its engine core, an in-process `LLM`), so once this distribution is
installed in the serving environment, `vllm serve` and `python -m vllm.entrypoints.openai.api_server`
get the mends as they are started, with no flag. Each mend checks vLLM's own code first and
replaces it only where that code fails the check; every mend made is logged on vLLM's logger with
the prefix "specdec mend:" (the pipeline reads those lines from a server's log).

The defects (vLLM 0.32's CPU build; a build that has them fixed passes the checks, and nothing is
replaced):
- expand: the CPU kernel that spreads each request's temperature, top-k and top-p over the draft
  tokens of a speculative round casts to int64 into a temporary and leaves the real output unset,
  so the rejection sampler reads arbitrary sampling parameters. Sampled outputs change
  (measured: chi-square 113-403 against a plain server at draft positions 1-3).
- empty top-k: the CPU top-k mask takes k.max() over a round's draft tokens and fails when the
  round has none; a top-k request whose drafter proposed nothing kills the engine.
- seeded requests: after a step whose sampled tokens are discarded, vLLM rewinds a seeded
  request's generator with `set_offset(get_offset() - 4)`, which a CPU generator refuses ("CPU
  Generator does not use offset"): the engine dies and every later request gets HTTP 500. Mended by
  giving seeded requests a CPU generator that carries the same seeded state and skips the rewind
  (offsets exist only on Philox generators). The draws stay exact draws from the target's
  distribution; what is lost is bit-identical output for the same seed across different
  schedules (the rewind keeps a discarded draw from shifting the stream).

Set SPECDEC_VLLM_MENDS=0 in a server's environment to load vLLM unmended (the sampling test's power
check does, to show it flags the defect).
"""

from __future__ import annotations

import logging
import os

MARK = "specdec mend:"
OFF_VARIABLE = "SPECDEC_VLLM_MENDS"

EXPAND_MEND = ("vLLM's CPU expand kernel (per-request temperature, top-k and top-p spread over the "
               "draft tokens of a speculative round) wrote them into an int64 copy and left the real "
               "output unset: replaced by one that keeps the dtype")
EMPTY_TOP_K_MEND = ("vLLM's CPU top-k mask failed on a round without draft tokens: a round without "
                    "drafts now passes through unchanged")
SEED_MEND = ("vLLM rewinds a seeded request's generator by offset, which CPU generators refuse "
             "(the engine died): seeded requests get a CPU generator that skips the rewind")


def _logger() -> logging.Logger:
    try:
        from vllm.logger import init_logger
    except ImportError:                   # imported outside vLLM (the pipeline's own tests)
        return logging.getLogger("specdec_vllm_mends")
    return init_logger("vllm.specdec_mends")


MADE: list[str] = []      # the mends made in this process, in order


def _said(line: str) -> None:
    MADE.append(line)
    _logger().warning("%s %s", MARK, line)


# --- expand ---------------------------------------------------------------------------------------
def expand_keeping_dtype(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """What vLLM's expand_batch_to_tokens computes, for any dtype: each request's value
    (replace_from read as replace_to) repeated over its draft tokens."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_empty(num_tokens)
    out[: int(ends[-1])] = torch.repeat_interleave(values, counts)
    return out


def expand_is_broken(expand) -> bool:
    """Whether `expand` loses a float32 value (what vLLM 0.32's CPU kernel does)."""
    import torch

    probe = torch.tensor([0.7, 0.25], dtype=torch.float32)
    cu = torch.tensor([3, 5], dtype=torch.int32)
    expected = torch.tensor([0.7] * 3 + [0.25] * 2)
    return not torch.allclose(expand(probe, cu, 5), expected)


def mend_expand(module) -> list[str]:
    """Replace module.expand_batch_to_tokens (read from its own module only) when it is broken."""
    if not expand_is_broken(module.expand_batch_to_tokens):
        return []
    module.expand_batch_to_tokens = expand_keeping_dtype
    return [EXPAND_MEND]


# --- empty top-k ----------------------------------------------------------------------------------
def top_k_top_p_allowing_empty(original):
    def apply(logits, k, p):
        return logits if logits.shape[0] == 0 else original(logits, k, p)
    apply.specdec_mended = True
    return apply


def top_k_fails_on_empty(apply) -> bool:
    import torch

    try:
        apply(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64), None)
    except RuntimeError:
        return True
    return False


def mend_empty_top_k(module) -> list[str]:
    if getattr(module.apply_top_k_top_p, "specdec_mended", False) or not top_k_fails_on_empty(
            module.apply_top_k_top_p):
        return []
    module.apply_top_k_top_p = top_k_top_p_allowing_empty(module.apply_top_k_top_p)
    return [EMPTY_TOP_K_MEND]


# --- seeded requests ------------------------------------------------------------------------------
def cpu_offsets_refused() -> bool:
    import torch

    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def _offset_free_class():
    import torch

    class OffsetFreeGenerator(torch.Generator):
        """A CPU generator whose offset rewind is skipped (see the module's docstring)."""

        def get_offset(self) -> int:
            return 0

        def set_offset(self, offset: int):
            return self

    return OffsetFreeGenerator


def offset_free_copy(generator):
    """A generator of OffsetFreeGenerator's class in `generator`'s state (the same draws follow)."""
    cls = _offset_free_class() if not hasattr(offset_free_copy, "cls") else offset_free_copy.cls
    offset_free_copy.cls = cls
    if isinstance(generator, cls) or generator.device.type != "cpu":
        return generator
    copy = cls(device="cpu")
    copy.set_state(generator.get_state())
    return copy


def mend_seeded_generators(runner_class) -> list[str]:
    """Wrap runner_class._update_states (where new requests get their seeded generators, before
    any draw) so that CPU generators are replaced by offset-free copies."""
    original = runner_class._update_states
    if getattr(original, "specdec_mended", False) or not cpu_offsets_refused():
        return []

    def _update_states(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        generators = self.input_batch.generators
        for index, generator in list(generators.items()):
            generators[index] = offset_free_copy(generator)
        for state in self.requests.values():
            if getattr(state, "generator", None) is not None:
                state.generator = offset_free_copy(state.generator)
        return result

    _update_states.specdec_mended = True
    runner_class._update_states = _update_states
    return [SEED_MEND]


# --- entry point ----------------------------------------------------------------------------------
def check_at_first_call(module, name: str, mend) -> None:
    """Put a wrapper in module.<name> that, at the first call, puts the original back, runs
    mend(module) (which checks it and replaces it only where it fails, logged) and calls whatever
    module.<name> then is."""
    original = getattr(module, name)
    if getattr(original, "specdec_checking", False):
        return

    def checking(*args, **kwargs):
        if getattr(module, name) is checking:
            setattr(module, name, original)
            for line in mend(module):
                _said(line)
        return getattr(module, name)(*args, **kwargs)

    checking.specdec_checking = True
    setattr(module, name, checking)


def mend_all() -> list[str]:
    """Every mend this vLLM's own code shows it needs, made; the lines of those made."""
    from vllm.v1.sample import rejection_sampler

    made = []
    # checked at their first call, when the engine's kernels are loaded (not at plugin load)
    check_at_first_call(rejection_sampler, "expand_batch_to_tokens", mend_expand)
    check_at_first_call(rejection_sampler, "apply_top_k_top_p", mend_empty_top_k)
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError as exc:          # a build without it: nothing of this kind to mend
        _logger().info("specdec mends: no GPUModelRunner to check (%s)", exc)
    else:
        made += mend_seeded_generators(GPUModelRunner)
    return made


def register() -> None:
    """vLLM's general-plugin entry point: runs in every vLLM process."""
    if os.environ.get(OFF_VARIABLE, "1").strip() == "0":
        _logger().warning("specdec mends: off (%s=0): vLLM runs unmended", OFF_VARIABLE)
        return
    for line in mend_all():
        _said(line)
