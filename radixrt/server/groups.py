"""n > 1 and beam search in the front: the /generate beam-search field rules (`validate`
calls them) and the limits `Front` checks after tokenization, before anything is sent: the
group must fit the running slots and the KV pool (the scheduler's rule and message,
`radixrt.limits.check_fits`) and beam search's candidates the top log-probs the
runner returns (`BeamSearchParams.check_candidates`). Every problem is an ApiError (400)
naming the field. Torch-free, like the rest of the front.
"""

from __future__ import annotations

from radixrt.errors import RequestValueError
from radixrt.limits import check_fits
from radixrt.sampling import MAX_BEAM_WIDTH, BeamSearchParams
from radixrt.server.messages import Ready
from radixrt.server.protocol import MAX_REQUESTS, ApiError, GenerationSpec
from radixrt.server.schemas import GenerateRequest, GenerateSamplingParams


def check_group_fits(
    ready: Ready, num_seqs: int, param: str, prompt_len: int, max_tokens: int
) -> None:
    """ApiError naming `param` unless `num_seqs` sequences of a prompt (sharing its full
    blocks) fit in the running slots and the KV pool together."""
    if num_seqs <= 1:
        return
    try:
        check_fits(
            prompt_len,
            max_tokens,
            num_seqs,
            param,
            num_slots=ready.max_running_requests,
            num_blocks=ready.kv_blocks_total,
            block_size=ready.block_size,
            max_model_len=ready.max_model_len,
        )
    except RequestValueError as e:
        raise ApiError(str(e), e.field) from None


def beam_params(
    ready: Ready, spec: GenerationSpec, prompt_len: int, max_tokens: int
) -> BeamSearchParams:
    """The beam search of one prompt (`spec.beam_width` set); ApiError naming the field when
    it cannot run on this server."""
    assert spec.beam_width is not None
    param = spec.beam_width_param
    if max_tokens < 1:
        raise ApiError(f"beam search needs {spec.max_tokens_param} >= 1", spec.max_tokens_param)
    beam = BeamSearchParams(
        beam_width=spec.beam_width,
        max_tokens=max_tokens,
        length_penalty=spec.length_penalty,
        ignore_eos=spec.sampling.ignore_eos,
        skip_special_tokens=spec.sampling.skip_special_tokens,
    )
    try:
        beam.check_candidates(ready.num_eos_ids)
    except ValueError as e:
        raise ApiError(str(e).replace("beam_width", param, 1), param) from e
    check_group_fits(ready, spec.beam_width, param, prompt_len, max_tokens)
    return beam


# what beam search defines besides beam_width and length_penalty: max_new_tokens,
# ignore_eos, skip_special_tokens. Every other field set to a non-default value is a 400.
# (field, the values allowed besides null)
_BEAM_REFUSED: tuple[tuple[str, tuple[object, ...]], ...] = (
    ("n", (1,)),
    ("temperature", (0,)),
    ("top_p", (1,)),
    ("top_k", (0, -1)),
    ("min_p", (0,)),
    ("seed", ()),
    ("stop", ([],)),
    ("stop_token_ids", ([],)),
    ("presence_penalty", (0,)),
    ("frequency_penalty", (0,)),
    ("repetition_penalty", (1,)),
    ("logit_bias", ({},)),
    ("stop_regex", ([],)),
    ("min_new_tokens", (0,)),
    ("no_stop_trim", (False,)),
)


def check_beam_fields(req: GenerateRequest, sp: GenerateSamplingParams, num_prompts: int) -> float:
    """Beam search's fields (ApiError naming the first bad one); returns length_penalty."""
    if not 1 <= sp.beam_width <= MAX_BEAM_WIDTH:
        raise ApiError(
            f"invalid sampling_params.beam_width={sp.beam_width}: must be an integer in "
            f"[1, {MAX_BEAM_WIDTH}] (and max(2, 1 + EOS ids) * beam_width <= 20)",
            param="sampling_params.beam_width",
        )
    if sp.beam_width * num_prompts > MAX_REQUESTS:
        raise ApiError(
            f"{num_prompts} prompts x sampling_params.beam_width={sp.beam_width} is "
            f"{sp.beam_width * num_prompts} sequences; at most {MAX_REQUESTS} per request",
            param="sampling_params.beam_width",
        )
    for name, allowed in _BEAM_REFUSED:
        value = getattr(sp, name)
        if value is not None and value not in allowed:
            raise ApiError(
                f"sampling_params.{name}={value!r:.60} is not defined for beam search "
                "(beam_width): beam search is deterministic and stops on EOS or max_new_tokens",
                param=f"sampling_params.{name}",
            )
    for name, bad in (
        ("stream", req.stream),
        ("return_logprob", req.return_logprob),
        ("return_prompt_logprob", req.return_prompt_logprob),
        ("top_logprobs_num", req.top_logprobs_num not in (0, None)),
    ):
        if bad:
            raise ApiError(
                f"{name} is not supported with beam search (beam_width): it returns each "
                "sequence at the end, with its cumulative_logprob and score",
                param=name,
            )
    penalty = 1.0 if sp.length_penalty is None else sp.length_penalty
    try:
        BeamSearchParams(beam_width=sp.beam_width, max_tokens=1, length_penalty=penalty)
    except ValueError as e:
        raise ApiError(str(e), param="sampling_params.length_penalty") from e
    return float(penalty)
