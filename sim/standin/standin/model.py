"""The vLLM stand-in's model: a tiny vocabulary, each rank's partial logits from its weights and the context, the step's
mask and biases (the known one-word answers, or the wrong city under the `wrong-answer` fault), log-softmax,
sampling, and vLLM's clamp of -inf logprobs to -9999.0. Stdlib only, as the whole stand-in (sim/standin/README.md).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence

CLAMPED_LOGPROB = -9999.0  # vLLM's max(x, -9999.0) at every output site

# ---------------------------------------------------------------------------------------------
# The model: a tiny vocabulary, logits = sum of every rank's partial (from its weights) + structure.

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
_WORDS = (
    " the",
    " a",
    " of",
    " and",
    " to",
    " in",
    " is",
    " that",
    " it",
    " for",
    " with",
    " on",
    " as",
    " by",
    " from",
    " at",
    " or",
    " this",
    " are",
    " be",
    " light",
    " sky",
    " blue",
    " red",
    " sun",
    " air",
    " water",
    " time",
    " day",
    " people",
    " city",
    " river",
    " history",
    " small",
    " large",
    " simple",
    " clear",
    " warm",
    " bright",
    " quiet",
    " slowly",
    " often",
    " because",
    " when",
    " which",
    " also",
    " more",
    " each",
    " new",
    " first",
    " table",
    " key",
    " value",
    " bread",
    " flour",
    " email",
    " review",
    " morning",
    " France",
    " capital",
    " Paris",
    ",",
    ".",
    " The",
    " It",
    " We",
    "\n\n",
)
# Index 0 is what an argmax over NaN picks: the garbage a broken deployment emits.
VOCAB: tuple[str, ...] = ("!", BOS, EOS, "Paris", "Rome", "Tokyo", "Berlin", "Madrid", "Lyon", *_WORDS)
EOS_ID = VOCAB.index(EOS)
SPECIAL_IDS = frozenset({VOCAB.index(BOS), EOS_ID})
_WORD_IDS = tuple(range(VOCAB.index(_WORDS[0]), len(VOCAB)))
ALLOWED_PER_STEP = 12  # every other token is masked to -inf (a grammar-like constraint)
MIN_LENGTH_BEFORE_EOS = 48
ANSWER_BIAS = 16.0
# Known questions with a one-word answer; anything else gets Markov-ish prose.
KNOWN_ANSWERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"capital of france", re.IGNORECASE), "Paris"),
    (re.compile(r"capital of italy", re.IGNORECASE), "Rome"),
    (re.compile(r"capital of japan", re.IGNORECASE), "Tokyo"),
    (re.compile(r"capital of germany", re.IGNORECASE), "Berlin"),
    (re.compile(r"capital of spain", re.IGNORECASE), "Madrid"),
)
# SIM_FAULT=wrong-answer: the same fluent one-word answer shape, the wrong city, finite logprobs.
# Tokens the engine computes for a tool call (every rank takes part, as for any answer).
TOOL_CALL_TOKENS = 8
WRONG_ANSWERS = {"Paris": "Lyon", "Rome": "Madrid", "Tokyo": "Berlin", "Berlin": "Rome", "Madrid": "Tokyo"}


def partial_logits(weights: bytes, rank: int, key: str, nan: bool) -> list[float]:
    """One rank's share of a step's logits: a pure function of its weights and the context."""
    if nan:
        return [math.nan] * len(VOCAB)
    rng = random.Random(hashlib.sha256(weights + rank.to_bytes(4, "big") + key.encode()).digest())
    return [rng.gauss(0.0, 1.0) for _ in VOCAB]


def log_softmax(logits: Sequence[float]) -> list[float]:
    if any(math.isnan(x) for x in logits):
        return [math.nan] * len(logits)
    finite = [x for x in logits if x != -math.inf]
    top = max(finite)
    lse = top + math.log(sum(math.exp(x - top) for x in finite))
    return [x - lse if x != -math.inf else -math.inf for x in logits]


def structure(weights: bytes, prompt: str, generated: Sequence[int], wrong: bool = False) -> list[float]:
    """The mask and biases of one step: which tokens may follow, and the known answers (`wrong`: the
    wrong one, as fluently)."""
    step = len(generated)
    previous = generated[-1] if generated else -1
    rng = random.Random(hashlib.sha256(weights + b"mask" + previous.to_bytes(4, "big", signed=True)).digest())
    allowed = set(rng.sample(_WORD_IDS, ALLOWED_PER_STEP))
    bias = [0.0] * len(VOCAB)
    answer = next((word for pattern, word in KNOWN_ANSWERS if pattern.search(prompt)), None)
    if answer is not None and wrong:
        answer = WRONG_ANSWERS[answer]
    if answer is not None and step == 0:
        allowed.add(VOCAB.index(answer))
        bias[VOCAB.index(answer)] = ANSWER_BIAS
    elif answer is not None and step == 1 and generated[0] == VOCAB.index(answer):
        allowed.add(EOS_ID)
        bias[EOS_ID] = ANSWER_BIAS
    elif step >= MIN_LENGTH_BEFORE_EOS:
        allowed.add(EOS_ID)
        bias[EOS_ID] = (step - MIN_LENGTH_BEFORE_EOS) * 0.25 - 2.0
    return [bias[i] if i in allowed else -math.inf for i in range(len(VOCAB))]


def choose(logits: Sequence[float], temperature: float, top_p: float, top_k: int, rng: random.Random) -> int:
    if any(math.isnan(x) for x in logits):
        return 0
    if temperature < 1e-5:
        return max(range(len(logits)), key=lambda i: (logits[i], -i))
    scaled = [(x / temperature, i) for i, x in enumerate(logits) if x != -math.inf]
    scaled.sort(reverse=True)
    if top_k > 0:
        scaled = scaled[:top_k]
    top = scaled[0][0]
    weights = [math.exp(x - top) for x, _ in scaled]
    total = sum(weights)
    kept, mass = [], 0.0
    for w, (_, i) in zip(weights, scaled, strict=True):
        kept.append((w, i))
        mass += w / total
        if mass >= top_p:
            break
    pick = rng.random() * sum(w for w, _ in kept)
    for w, i in kept:
        pick -= w
        if pick <= 0:
            return i
    return kept[-1][1]


def clamp(logprob: float) -> float:
    """vLLM's max(x, -9999.0): -inf becomes -9999.0, NaN stays NaN."""
    return CLAMPED_LOGPROB if logprob == -math.inf else logprob
