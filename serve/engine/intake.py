"""What `Engine.submit` and `Engine.submit_prompt` check before a turn is queued: the session,
the token ids, the sampling parameters, the directives and the turn's SCRATCH and MOVE
options. A refusal raises before anything is queued (KeyError for the session, ValueError for
ids and options, DirectiveError for directives); what depends on the session as it will be
when the turn runs is checked then (`serve.engine.scheduler`)."""

from __future__ import annotations

from leyline_jax import directives as dv
from leyline_jax.config import check_tokens
from leyline_jax.directives import Directive, Mode
from serve import spans
from serve.engine.types import Request, Session
from serve.sampling import SamplingParams


def check_sampling(sampling, vocab: int) -> SamplingParams:
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    bad = [t for t in sampling.stop_tokens if t >= vocab]
    if bad:
        raise ValueError(f"stop token {bad[0]} is outside the vocabulary [0, {vocab})")
    return sampling


def _no_page_sources(ds) -> None:
    """A caller's MOVE takes its sources from the session's own tokens: sources in other pages
    (`Source.pages`) are the engine's to choose (within a lineage), never a caller's."""
    for d in ds:
        if any(x.pages for x in d.sources):
            raise dv.DirectiveError(
                f"directive [{d.start}, {d.end}): a MOVE source with pages= reads KV the "
                "session does not hold; a turn's MOVE sources are positions in its session"
            )


def turn(engine, s: Session, tokens, directives, sampling, vocab: int) -> Request:
    """A `submit` turn: new tokens and directives in the session's coordinates."""
    sampling = check_sampling(sampling, vocab)
    toks = check_tokens(tokens, vocab, allow_empty=True).tolist()
    if not toks and not s.tokens and not engine.table.busy(s):
        raise ValueError("the first turn of a session needs at least one token")
    try:
        ds = list(directives)
    except TypeError as e:
        raise dv.DirectiveError(f"directives must be a sequence of Directive: {e}") from e
    for d in ds:
        if not isinstance(d, Directive):
            raise dv.DirectiveError(f"{d!r} is not a Directive")
    _no_page_sources(ds)
    return Request(engine, s, toks, ds, sampling)


def prompt_turn(engine, s: Session, prompt, mode, directives, sampling, vocab: int):
    """A `submit_prompt` turn: a whole prompt, with explicit directives in its coordinates.
    Returns the turn and the length of the prompt it runs (scratch spans are checked
    against it)."""
    sampling = check_sampling(sampling, vocab)
    toks = check_tokens(prompt, vocab).tolist()
    if mode not in (Mode.AMORTIZE, Mode.FORGET):
        raise ValueError(f"mode={mode!r} must be Mode.AMORTIZE or Mode.FORGET")
    try:
        ds = dv.validate(list(directives), len(toks), vocab)
    except TypeError as e:
        raise dv.DirectiveError(f"directives must be a sequence of Directive: {e}") from e
    if any(d.mode is Mode.DECAY for d in ds):
        raise dv.DirectiveError(
            "a DECAY's text depends on the session's KV: send it with submit (session "
            "coordinates), not inside a whole prompt"
        )
    _no_page_sources(ds)
    final = dv.apply_to_list(toks, ds)
    if not final:
        raise dv.DirectiveError("the directives leave the prompt empty")
    req = Request(engine, s, [], ds, sampling)
    req.prompt, req.mode = toks, mode
    return req, len(final)


def options(req: Request, scratch, scratch_tags, move, length, vocab: int, recompute=None):
    """Check and set a turn's SCRATCH, MOVE and recompute options (spans against `length`,
    the prompt's, when known now; else when the turn runs). Returns the turn."""
    try:
        req.scratch = [tuple(x) for x in scratch]
    except TypeError as e:
        raise dv.DirectiveError(f"scratch must be (start, end) pairs: {e}") from e
    if length is not None:
        req.scratch = spans.check_spans(req.scratch, length, "scratch span")
    if scratch_tags is not None:
        try:
            o, c = scratch_tags
        except (TypeError, ValueError) as e:
            raise ValueError(f"scratch_tags must be (open ids, close ids): {e}") from e
        req.scratch_tags = tuple(tuple(check_tokens(x, vocab).tolist()) for x in (o, c))
    if move is not None and not isinstance(move, bool):
        raise ValueError(f"move must be a bool or None, got {move!r}")
    req.move = move
    req.recompute = None if recompute is None else dv.check_recompute(recompute)
    return req
