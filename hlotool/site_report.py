"""What was decided for each site of a traced function: one record per site, read by every
command (`explain`'s text, `rewrite`'s and `diff`'s tables, JSON) and never parsed back.

A site either stays native on every platform for one reason (`blocker`: no kernel call
reproduces it, its intermediates are used elsewhere, ...) or carries one
`hlotool.cost.decision.Choice` per platform, each with its refusals and its verdict; `notes`
are facts about the rewrite that hold on every platform (a recompute in the backward loop).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from hlotool.cost.decision import Choice
from hlotool.site import AttentionSite


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """One site's outcome."""

    site: AttentionSite
    where: str
    choices: Mapping[str, Choice]
    blocker: str = ""
    notes: tuple[str, ...] = ()
    trained: bool = False  # the program differentiates the site: priced forward and backward

    @classmethod
    def native(cls, site: AttentionSite, where: str, platforms: tuple[str, ...], reason: str
               ) -> SiteReport:
        """The site kept native on every platform for one reason."""
        return cls(site, where, {p: Choice(p, None, reason) for p in platforms}, blocker=reason)

    @property
    def kernels(self) -> dict[str, str | None]:
        """Platform → the kernel that runs the site there, None where native."""
        return {p: c.kernel for p, c in self.choices.items()}

    @property
    def rewritten(self) -> bool:
        return any(self.kernels.values())

    def groups(self) -> list[tuple[Choice, ...]]:
        """The platforms' choices grouped where they share a decision (kernel and reason),
        in platform order: a reason is said once, naming every platform it holds for."""
        out: dict[tuple, list[Choice]] = {}
        for choice in self.choices.values():
            out.setdefault((choice.kernel, choice.reason, choice.refusals), []).append(choice)
        return [tuple(group) for group in out.values()]

    @property
    def reason(self) -> str:
        """Everything decided, as one line: the blocker, or each group's reason; then the
        notes."""
        if self.blocker:
            return "; ".join((self.blocker, *self.notes))
        return "; ".join((*map(describe, self.groups()), *self.notes))

    def to_json(self) -> dict[str, Any]:
        return {"site": self.site.to_json(), "where": self.where, "kernels": self.kernels,
                "rewritten": self.rewritten, "reason": self.reason, "blocker": self.blocker,
                "notes": list(self.notes), "trained": self.trained,
                "choices": {p: c.to_json() for p, c in self.choices.items()}}


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-site decisions for one traced function; `str()` is a text a person reads."""

    function: str
    sites: tuple[SiteReport, ...]
    note: str = ""  # why nothing was looked at, when the whole program was left alone

    @property
    def rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    def to_json(self) -> dict[str, Any]:
        out = {"function": self.function, "sites": [s.to_json() for s in self.sites]}
        if self.note:
            out["note"] = self.note
        return out

    def __str__(self) -> str:
        if self.note:
            return f"{self.function}: left native: {self.note}"
        if not self.sites:
            return f"{self.function}: no attention site"
        lines = [f"{self.function}: {len(self.sites)} site(s), {self.rewritten} rewritten"]
        for i, s in enumerate(self.sites):
            lines.append(f"  [{i}] {headline(s)}")
            if s.blocker:
                lines.append(f"      {', '.join(s.choices)}: native — {s.blocker}")
            else:
                lines.extend(f"      {describe(group)}" for group in s.groups())
            lines.extend(f"      {note}" for note in s.notes)
        return "\n".join(lines)


def headline(s: SiteReport) -> str:
    """"model.py:12 (in forward) q[2, 1, 8, 64] k[2, 4096, 8, 64] bfloat16 mask=key padding,
    decode step": where the site is and what it is."""
    a = s.site
    return (f"{a.source or '?'} ({s.where}) q{list(a.q_shape)} k{list(a.k_shape)} {a.dtype} "
            f"mask={a.mask_text}{''.join(', ' + v for v in a.variants)}")


def describe(group: tuple[Choice, ...]) -> str:
    """"tpu (tpu-v5e): pallas_tpu — kernel pays (…); passed over splash_tpu: …": platforms
    that share a decision (each with the chip it was priced on where that is another
    name), what runs there and why, and the kernels the table passed over."""
    names = ", ".join(c.platform + (f" ({c.chip})" if c.chip and c.chip != c.platform else "")
                      for c in group)
    first = group[0]
    if first.kernel is None and first.reason.startswith("keep native"):
        text = f"{names}: {first.reason}"  # the verdict says "native" itself
    else:
        text = f"{names}: {first.kernel or 'native'} — {first.reason}"
    blocks = first.verdict.kernel.score_blocks if first.verdict and first.verdict.kernel else None
    if first.priced is not None and blocks is not None and blocks.skipped:
        text += (f"; the band skips {blocks.skipped} of {blocks.total} score tiles "
                 f"({blocks.block_q}×{blocks.block_k}) per head")
    # Where no kernel was priced, the reason already names every refusal.
    if first.refusals and first.priced is not None:
        text += "; passed over " + "; ".join(map(str, first.refusals))
    return text
