"""What a training run costs: days and dollars to train N tokens, on-demand and on spot capacity.

Pure arithmetic over a plan's predicted throughput (no torch). Spot capacity is preempted at a
rate per node-hour; the run checkpoints every tau seconds, and each preemption loses the work
since the last checkpoint plus a restart. The interval is Young's first-order optimum
(Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9);
Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22(3), eq. 2): tau = sqrt(2 C M), C the checkpoint write time, M the job's mean time
between preemptions. The expected wall time is Daly's first-order model (sec. 2): a segment is
tau of work plus C of checkpoint; a preemption costs the restart R plus, on average, half a
segment; preemptions arrive at 1/M, so

    T = W (1 + C / tau) / (1 - (R + (tau + C) / 2) / M)

and no finite T exists when a preemption comes, on average, before a segment and a restart are
done (denominator <= 0). Prices per GPU-hour come from profiles/prices.json (each with its
page and date) or --gpu-hour-price.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import SpecError

PRICES_PATH = Path(__file__).resolve().parents[2] / "profiles" / "prices.json"
YEAR_DAYS = 365.0
"""A plan that needs longer than this to train its tokens is flagged: nobody runs it."""
DEFAULT_TOKENS = 100e9
"""Tokens to train when the model has no published training run on file."""
MAX_PRICE = 1000.0
"""USD per GPU-hour above which a price is taken for a typo (list prices are ~1-15)."""
MAX_RATE = 60.0
"""Preemptions per node-hour above which the rate is absurd (one a minute)."""
MAX_TOKENS = 1e16

# Published training runs (tokens seen in pre-training), for --tokens' default.
PUBLISHED_TOKENS: dict[str, tuple[float, str]] = {
    "glm-130b": (400e9, "GLM-130B was trained on 400 billion tokens (Zeng et al. 2022, GLM-130B, sec. 1)"),
    "chatglm-6b": (1e12, "ChatGLM-6B: about 1T tokens of Chinese and English (THUDM/ChatGLM-6B README)"),
    "chatglm2-6b": (1.4e12, "ChatGLM2-6B: 1.4T tokens of Chinese and English (THUDM/ChatGLM2-6B README)"),
    "glm-4-9b": (10e12, "GLM-4-9B: pre-trained on 10T tokens (THUDM/GLM-4 README)"),
}

CHECKPOINT_BYTES_PER_PARAM = {"bf16": 14.0, "fp16": 14.0, "fp32": 12.0}
"""Bytes a DeepSpeed checkpoint holds per parameter: the 16-bit module weights (2) and the
optimizer's fp32 master copy and two Adam moments (12, Rajbhandari et al. 2020, ZeRO, sec. 3:
K = 12); in fp32 the weights are the master copy (4 + 8). Gradients are not saved."""


def default_tokens(model_name: str) -> tuple[float, str]:
    """(tokens, where the number comes from) for a model with no --tokens."""
    key = model_name.split("+")[0].lower()
    if key in PUBLISHED_TOKENS:
        return PUBLISHED_TOKENS[key]
    return DEFAULT_TOKENS, "no published training run on file for this model: 100B tokens (--tokens)"


# --- inputs --------------------------------------------------------------------------------------
def check_tokens(tokens: float) -> float:
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not (0 < tokens <= MAX_TOKENS):
        raise SpecError("--tokens", f"must be a number of tokens in (0, {MAX_TOKENS:.0e}], got {tokens!r}",
                        "give the tokens to train, e.g. --tokens 4e11")
    return float(tokens)


def check_price(price: float, flag: str = "--gpu-hour-price") -> float:
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not (0 < price <= MAX_PRICE):
        raise SpecError(flag, f"must be USD per GPU-hour in (0, {MAX_PRICE:g}], got {price!r}",
                        f"give the price of one GPU for one hour, e.g. {flag} 2.5")
    return float(price)


def check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (0 < rate <= MAX_RATE):
        raise SpecError("--preemption-rate", f"must be preemptions per node-hour in (0, {MAX_RATE:g}], got {rate!r}",
                        "give the rate your spot pool shows, e.g. --preemption-rate 0.05 (one per 20 node-hours)")
    return float(rate)


def check_restart(minutes: float) -> float:
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not (0 <= minutes <= 24 * 60):
        raise SpecError("--restart-min", f"must be minutes in [0, 1440], got {minutes!r}",
                        "give the minutes from a preemption to training again, e.g. --restart-min 10")
    return float(minutes)


# --- prices --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Price:
    """One published price of one GPU for one hour."""

    usd_per_gpu_hour: float
    kind: str
    """on_demand, capacity_block (reserved ahead, not preempted) or spot; "given" for --gpu-hour-price."""
    provider: str = ""
    instance: str = ""
    as_of: str = ""
    """The date or period the page gives for the price."""
    source: str = ""
    """Page (URL) and what it says."""
    note: str = ""
    """What else to know about the price (a newer cut, a borrowed GPU)."""

    def text(self) -> str:
        """The price and what it is, in a few words (the page is in `source`)."""
        if self.kind == "given":
            return f"${self.usd_per_gpu_hour:,.2f}/GPU-hour ({self.source or '--gpu-hour-price'})"
        where = " ".join(x for x in (self.provider, self.instance) if x)
        return f"${self.usd_per_gpu_hour:,.3g}/GPU-hour ({where}, {self.kind.replace('_', '-')}, as of {self.as_of})"

    def to_dict(self) -> dict[str, Any]:
        return {"usd_per_gpu_hour": self.usd_per_gpu_hour, "kind": self.kind, "provider": self.provider,
                "instance": self.instance, "as_of": self.as_of, "source": self.source, "note": self.note}


def load_prices(path: Path = PRICES_PATH) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def price_for(device: str, kind: str, prices: dict[str, Any] | None = None) -> Price | None:
    """The default published price of `device` (a profile name) for on_demand or spot, or None."""
    prices = load_prices() if prices is None else prices
    offer_id = prices.get("defaults", {}).get(device, {}).get(kind)
    if offer_id is None:
        return None
    o = prices["offers"][offer_id]
    return Price(usd_per_gpu_hour=float(o["usd_per_gpu_hour"]), kind=o["kind"], provider=o.get("provider", ""),
                 instance=o.get("instance", ""), as_of=o.get("as_of", ""), source=o.get("source", ""),
                 note=o.get("note", ""))


def exchange_rate(currency: str, prices: dict[str, Any] | None = None) -> tuple[float, str] | None:
    """(units of `currency` per US dollar, "as of ...; source") from prices.json, or None."""
    prices = load_prices() if prices is None else prices
    r = prices.get("exchange_rates", {}).get(currency)
    return None if not isinstance(r, dict) else (float(r["per_usd"]), f"{r['as_of']}; {r['source']}")


# --- checkpoints ---------------------------------------------------------------------------------
def checkpoint_seconds(params: float, precision: str, *, nodes: int, gpus_per_node: int, tp: int, pp: int,
                       zero: int, write_gbps: float) -> float:
    """Seconds to write one checkpoint: each node writes its share at write_gbps (GB/s per node).
    The module weights come from one data-parallel replica (its nodes), unless ZeRO-3 partitions
    them over every rank; the optimizer states from every node when they are sharded over DP
    (ZeRO >= 1, or ZeRO-0 with a bf16 pipeline, DeepSpeed's BF16_Optimizer), else from the
    replica's nodes. The slowest node sets the time."""
    if write_gbps <= 0:
        return math.inf
    per = CHECKPOINT_BYTES_PER_PARAM.get(precision, 14.0)
    weights = params * (per - 12.0)
    optim = params * 12.0
    replica = min(nodes, max(1, math.ceil(tp * pp / gpus_per_node)))
    w_nodes = nodes if zero == 3 else replica
    sharded = zero >= 1 or (pp > 1 and precision == "bf16")
    o_nodes = nodes if sharded else replica
    return (weights / w_nodes + optim / o_nodes) / (write_gbps * 1e9)


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval, sqrt(2 C M) (Young 1974; Daly 2006 eq. 2)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def spot_wall_seconds(work_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float,
                      interval_s: float) -> float:
    """Expected wall time of work_s of training on preemptible capacity (Daly 2006, sec. 2,
    first order): T = W (1 + C/tau) / (1 - (R + (tau + C)/2) / M); inf when it never finishes."""
    lost = restart_s + (interval_s + checkpoint_s) / 2.0
    denom = 1.0 - lost / mtbf_s
    if denom <= 0:
        return math.inf
    return work_s * (1.0 + checkpoint_s / interval_s) / denom


# --- the bill ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SpotBill:
    preemption_rate: float
    """Preemptions per node-hour."""
    mtbf_h: float
    """The job's mean time between preemptions: 1 / (rate x nodes)."""
    checkpoint_s: float
    restart_s: float
    interval_s: float
    """Young/Daly checkpoint interval."""
    wall_s: float
    preemptions: float
    """Expected preemptions over the run."""
    lost_s_each: float
    """Expected time lost per preemption: the restart plus half a segment."""
    price: Price | None
    cost: float | None

    @property
    def days(self) -> float:
        return self.wall_s / 86400.0

    def to_dict(self) -> dict[str, Any]:
        fin = math.isfinite(self.wall_s)
        return {"preemption_rate_per_node_hour": self.preemption_rate, "mtbf_hours": self.mtbf_h,
                "checkpoint_write_s": self.checkpoint_s, "restart_s": self.restart_s,
                "checkpoint_interval_s": self.interval_s, "days": self.days if fin else None,
                "finishes": fin, "expected_preemptions": self.preemptions if fin else None,
                "lost_s_per_preemption": self.lost_s_each,
                "price": self.price.to_dict() if self.price else None, "cost_usd": self.cost}


@dataclass(frozen=True, slots=True, kw_only=True)
class Bill:
    tokens: float
    tokens_note: str
    tokens_per_s: float
    gpus: int
    compute_s: float
    """Tokens / tokens per second: the run with nothing going wrong."""
    price: Price | None
    """The on-demand (or --gpu-hour-price) price; None when none is on file."""
    spot: SpotBill | None = None

    @property
    def days(self) -> float:
        return self.compute_s / 86400.0

    @property
    def gpu_hours(self) -> float:
        return self.compute_s / 3600.0 * self.gpus

    @property
    def cost(self) -> float | None:
        return self.gpu_hours * self.price.usd_per_gpu_hour if self.price else None

    @property
    def over_a_year(self) -> bool:
        return self.days > YEAR_DAYS or (self.spot is not None and not self.spot.days <= YEAR_DAYS)

    def objective(self) -> float:
        """What --objective cost minimises: the spot cost with --spot, else the on-demand cost
        (GPU-hours where no price is known, which ranks as throughput does)."""
        if self.spot is not None and self.spot.cost is not None:
            return self.spot.cost
        c = self.cost
        return c if c is not None else self.gpu_hours

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_note": self.tokens_note, "tokens_per_s": self.tokens_per_s,
                "gpus": self.gpus, "days": self.days, "gpu_hours": self.gpu_hours,
                "over_a_year": self.over_a_year, "price": self.price.to_dict() if self.price else None,
                "cost_usd": self.cost, "spot": self.spot.to_dict() if self.spot else None}


@dataclass(frozen=True, slots=True, kw_only=True)
class BillSpec:
    """The user's cost inputs (--tokens, --gpu-hour-price, --spot, --preemption-rate, --restart-min)."""

    tokens: float
    tokens_note: str
    price: Price | None
    spot: bool = False
    spot_price: Price | None = None
    preemption_rate: float = 0.0
    restart_min: float = 10.0


def train_bill(spec: BillSpec, tokens_per_s: float, gpus: int, *, nodes: int, checkpoint_s: float) -> Bill:
    """Days and cost to train spec.tokens at tokens_per_s on `gpus` GPUs over `nodes` nodes."""
    compute = spec.tokens / tokens_per_s if tokens_per_s > 0 else math.inf
    spot = None
    if spec.spot:
        mtbf = 3600.0 / (spec.preemption_rate * nodes)
        tau = young_daly_interval(checkpoint_s, mtbf)
        restart = spec.restart_min * 60.0 + checkpoint_s      # relaunch, then read the checkpoint back
        wall = spot_wall_seconds(compute, checkpoint_s, restart, mtbf, tau)
        cost = wall / 3600.0 * gpus * spec.spot_price.usd_per_gpu_hour \
            if spec.spot_price and math.isfinite(wall) else None
        spot = SpotBill(preemption_rate=spec.preemption_rate, mtbf_h=mtbf / 3600.0, checkpoint_s=checkpoint_s,
                        restart_s=restart, interval_s=tau, wall_s=wall, preemptions=wall / mtbf,
                        lost_s_each=restart + (tau + checkpoint_s) / 2.0, price=spec.spot_price, cost=cost)
    return Bill(tokens=spec.tokens, tokens_note=spec.tokens_note, tokens_per_s=tokens_per_s, gpus=gpus,
                compute_s=compute, price=spec.price, spot=spot)


def plan_bill(spec: BillSpec, est: Any, plan: Any, params: float, cluster: Any) -> Bill:
    """train_bill for one plan's estimate on a cluster (ClusterSpec): the checkpoint time from
    the model's parameters over the profile's checkpoint write bandwidth (host.checkpoint_gbps)."""
    ckpt = checkpoint_seconds(params, plan.precision, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
                              tp=plan.tp, pp=plan.pp, zero=plan.zero, write_gbps=cluster.host.checkpoint_gbps)
    return train_bill(spec, est.tokens_per_s, plan.world_size, nodes=cluster.nodes, checkpoint_s=ckpt)


def duration_text(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never (preempted before a checkpoint and a restart are done)"
    days = seconds / 86400.0
    if days >= 2 * YEAR_DAYS:
        return f"{days / YEAR_DAYS:,.1f} years"
    if days >= 1:
        return f"{days:,.1f} days"
    return f"{seconds / 3600.0:,.1f} hours"


def tokens_text(tokens: float) -> str:
    return f"{tokens / 1e12:,.3g}T" if tokens >= 1e12 else f"{tokens / 1e9:,.3g}B"


def bill_lines(bill: Bill) -> list[str]:
    """The CLI's lines for one plan's bill, then each price's source."""
    out = [f"to train {tokens_text(bill.tokens)} tokens ({bill.tokens_note}): {duration_text(bill.compute_s)} on "
           f"{bill.gpus} GPUs, {bill.gpu_hours:,.0f} GPU-hours"
           + (f", ${bill.cost:,.0f} on-demand at {bill.price.text()}" if bill.price else
              "; no price on file for this GPU: pass --gpu-hour-price for the cost")]
    s = bill.spot
    if s is not None:
        money = f", ${s.cost:,.0f} at {s.price.text()}" if s.cost is not None else \
            ("" if s.price else "; no spot price on file for this GPU: pass --spot-price")
        out.append(f"on spot ({s.preemption_rate:g} preemptions per node-hour: one every {s.mtbf_h:,.1f} h for the "
                   f"job): checkpoint {s.checkpoint_s:,.0f} s to write, every {s.interval_s / 60:,.0f} min (Young/Daly); "
                   f"each preemption loses {s.lost_s_each / 60:,.0f} min (restart {s.restart_s / 60:,.0f} min); "
                   f"{duration_text(s.wall_s)}" + (f", {s.preemptions:,.0f} preemptions" if math.isfinite(s.wall_s)
                                                   else "") + money)
    if bill.over_a_year:
        out.append(f"warning: this plan needs more than {YEAR_DAYS:.0f} days to train {tokens_text(bill.tokens)} "
                   "tokens: no one would run it; use more or faster GPUs, or fewer tokens")
    for label, p in (("on-demand", bill.price), ("spot", s.price if s else None)):
        if p is not None and p.kind != "given":
            out.append(f"  {label} price source: {p.source}" + (f" (note: {p.note})" if p.note else ""))
    return out
