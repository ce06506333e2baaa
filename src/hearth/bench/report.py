"""The benchmark's Markdown table: one row per measurement, with its roofline."""

from __future__ import annotations

from dataclasses import dataclass, field

DECODE, PREFILL, FIRST_TOKEN = "decode", "prefill", "first token"
HF_DECODE, HF_PREFILL = "HF decode", "HF prefill"
COLUMNS = ("phase", "tokens", "tok/s", "ms", "work", "roofline tok/s", "of roofline", "path")
_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


@dataclass(frozen=True)
class Row:
    """One measurement. `tokens`: the context (decode) or prompt length (prefill, first token).

    `seconds`: per token for decode, for the whole prompt otherwise. `work`: bytes one decode
    step reads, or a prefill's FLOPs; `roofline_seconds`: the time that work takes at the
    bandwidth or peak.
    """

    phase: str
    tokens: int
    seconds: float
    path: str
    work: float | None = None
    roofline_seconds: float | None = None

    @property
    def tokens_per_second(self) -> float | None:
        if self.phase == FIRST_TOKEN:
            return None
        per_step = self.phase in (DECODE, HF_DECODE)
        return 1 / self.seconds if per_step else self.tokens / self.seconds

    @property
    def roofline_tokens_per_second(self) -> float | None:
        if self.roofline_seconds is None:
            return None
        per_step = self.phase in (DECODE, HF_DECODE)
        return 1 / self.roofline_seconds if per_step else self.tokens / self.roofline_seconds

    @property
    def work_unit(self) -> str:
        return "B" if self.phase == DECODE else "FLOP"


@dataclass
class BenchReport:
    model: str
    date: str
    device: str
    versions: str  # "torch X, triton Y"
    settings: str  # batch, steps, bandwidth and peak the rooflines use
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, phase: str, tokens: int | None = None) -> Row | None:
        return next((r for r in self.rows if r.phase == phase and tokens in (None, r.tokens)), None)


def si(value: float, unit: str) -> str:
    """`value` with an SI prefix and 4 significant digits, e.g. 23.49 GB."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.4g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def render(report: BenchReport) -> str:
    lines = [
        f"# hearth bench: {report.model}",
        "",
        f"{report.date} · {report.device} · {report.versions} · {report.settings}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in report.rows:
        speed, roofline = row.tokens_per_second, row.roofline_tokens_per_second
        share = None if speed is None or roofline is None else speed / roofline
        cells = [
            row.phase,
            str(row.tokens),
            _cell(speed, ",.1f"),
            f"{row.seconds * 1e3:,.2f}",
            "" if row.work is None else si(row.work, row.work_unit),
            _cell(roofline, ",.1f"),
            _cell(share, ".1%"),
            row.path,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if report.notes:
        lines += ["", *report.notes]
    return "\n".join(lines) + "\n"
