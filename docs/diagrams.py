"""The learner's path's data-flow pictures, drawn as SVG from the lists below.

Each section's picture is a chain of boxes, the forward pass left to right (solid arrows), and
under it the backward pass right to left (dashed arrows, each labelled with the gradient it
carries); arcs above the chain are paths that skip boxes (a residual connection). The SVGs are
written to ``docs/images/flow-<section>.svg`` by ``python docs/diagrams.py`` and kept in the
repository so that the pages show them on GitHub too; ``--check`` (run by the tests) fails
when a file differs from what this script draws.
"""
from __future__ import annotations

import argparse
import html
import sys
from dataclasses import dataclass, field
from pathlib import Path

IMAGES = Path(__file__).resolve().parent / "images"


@dataclass
class Flow:
    title: str
    nodes: list[str]                               # box texts, lines split by "\n"
    back: list[str]                                # per edge i (node i -> i + 1): the gradient going back
    skips: list[tuple[int, int, str]] = field(default_factory=list)   # (from node, to node, label) arcs above
    accent: set[int] = field(default_factory=set)  # boxes drawn as the section's subject


FLOWS = {
    "1": Flow("§1: one window of the corpus trains T predictions",
              ["a window of\nT + 1 tokens", "inputs x\ntargets y (shifted)", "the model", "logits z\n(B, T, V)",
               "p = softmax(z)", "loss L\n−mean log p_y"],
              ["", "", "dz: the model's backward", "", "dz = (p − e_y)/N"], accent={4, 5}),
    "2": Flow("§2: tokens and positions become vectors",
              ["token ids\n(B, T)", "rows of W_te\n(B, T, C)", "+ rows of W_pe\n(T, C)", "x\n(B, T, C)",
               "the blocks"],
              ["dW_te: scatter-add", "", "dW_pe: sum over b", "dx"], accent={1, 2}),
    "3": Flow("§3: one head of causal self-attention",
              ["X\n(B, T, C)", "Q, K, V\n= X W + b", "S = Q Kᵀ/√D_k\n+ mask M", "P = softmax(S)\nrow by row",
               "Y = P V", "out = Y W_o\n+ b_o"],
              ["dX, dW, db", "dQ, dK", "dS = P⊙(dP − rowsum)", "dP = dY Vᵀ", "dY = d·out W_oᵀ"],
              skips=[(1, 4, "V (and dV = Pᵀ dY back)")], accent={2, 3, 4}),
    "4": Flow("§4: H heads side by side",
              ["X\n(B, T, C)", "one product:\nevery Q, K, V", "H views\n(B, H, T, D)", "each head: §3\nY_h = P_h V_h",
               "[Y_1|…|Y_H]\n(B, T, H D_v)", "out = ·W_o + b_o"],
              ["dX", "dQ, dK, dV in\ntheir columns", "", "dY_h: head h's\ncolumns of dY", "dY = d·out W_oᵀ"],
              accent={2, 3, 4}),
    "5": Flow("§5: layer normalization, per token",
              ["x\n(B, T, C)", "μ, σ² over\nthe C channels", "x̂ = (x − μ)\n/ √(σ² + ε)", "y = γ ⊙ x̂ + β"],
              ["dx = r(dx̂ − mean(dx̂)\n− x̂ mean(dx̂ ⊙ x̂))", "", "dx̂ = γ ⊙ dy;  dγ, dβ"], accent={1, 2}),
    "6": Flow("§6: LoRA beside a frozen weight",
              ["x\n(B, T, in)", "h = x D\n(B, T, R)", "s · h U\n(B, T, out)", "y = x W + b\n+ s h U"],
              ["dD = xᵀ dh", "dU = s hᵀ dy; dh", "dy"], skips=[(0, 3, "x W + b: W, b frozen (no gradient kept)")],
              accent={1, 2}),
    "7": Flow("§7: a pre-LN block, twice residual",
              ["x", "LN₁", "attention\n(§3–§4)", "h = x + ·", "LN₂", "MLP\n(GELU)", "x' = h + ·"],
              ["§5", "§3", "", "§5", "dMLP", ""],
              skips=[(0, 3, "x: the gradient comes back whole"), (3, 6, "h: dh = dx' + (MLP path)")],
              accent={3, 6}),
}

W, BOX_H, TOP = 760, 54, 58          # picture width; box height; the boxes' top edge (room for arcs)
GAP = 26                              # between boxes
FONT = "font-family: system-ui, sans-serif"


def _text(x: float, y: float, lines: list[str], size: int, anchor: str = "middle", weight: str = "normal",
          colour: str = "#222") -> str:
    first = y - (len(lines) - 1) * size * 0.6
    spans = "".join(f'<tspan x="{x:.1f}" y="{first + i * size * 1.2:.1f}">{html.escape(t)}</tspan>'
                    for i, t in enumerate(lines))
    return (f'<text style="{FONT}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{colour}">{spans}</text>')


def draw(flow: Flow) -> str:
    n = len(flow.nodes)
    box_w = (W - 20 - GAP * (n - 1)) / n
    xs = [10 + i * (box_w + GAP) for i in range(n)]
    bottom = TOP + BOX_H
    lane = bottom + 26                                   # the backward arrows' level
    height = lane + 58
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="100%" role="img" '
           f'aria-label="{html.escape(flow.title)}">',
           '<defs><marker id="a" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker>'
           '<marker id="b" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#c0392b"/></marker></defs>',
           _text(10, 14, [flow.title], 13, "start", "bold")]
    for i, (x, label) in enumerate(zip(xs, flow.nodes)):
        fill = "#dbe8f5" if i in flow.accent else "#f4f4f4"
        out.append(f'<rect x="{x:.1f}" y="{TOP}" width="{box_w:.1f}" height="{BOX_H}" rx="6" fill="{fill}" '
                   f'stroke="#557"/>')
        out.append(_text(x + box_w / 2, TOP + BOX_H / 2 + 4, label.split("\n"), 12))
        if i + 1 < n:
            out.append(f'<line x1="{x + box_w:.1f}" y1="{TOP + BOX_H / 2}" x2="{xs[i + 1] - 1:.1f}" '
                       f'y2="{TOP + BOX_H / 2}" stroke="#444" stroke-width="1.5" marker-end="url(#a)"/>')
    for i, label in enumerate(flow.back):
        if not label:
            continue
        a, b = xs[i] + box_w * 0.75, xs[i + 1] + box_w * 0.25
        out.append(f'<path d="M{b:.1f},{bottom} V{lane} H{a:.1f} V{bottom + 2}" fill="none" stroke="#c0392b" '
                   f'stroke-width="1.4" stroke-dasharray="5 3" marker-end="url(#b)"/>')
        out.append(_text((a + b) / 2, lane + 18 + 12 * (i % 2) * (len(label.split("\n")) == 1),
                         label.split("\n"), 11, colour="#c0392b"))
    for k, (i, j, label) in enumerate(flow.skips):
        a, b = xs[i] + box_w / 2, xs[j] + box_w / 2
        top = 26 + 8 * k
        out.append(f'<path d="M{a:.1f},{TOP} C{a:.1f},{top} {b:.1f},{top} {b:.1f},{TOP - 1}" fill="none" '
                   f'stroke="#557" stroke-width="1.3" marker-end="url(#a)"/>')
        out.append(_text((a + b) / 2, top + 10, [label], 11, colour="#335"))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a picture differs from what this script draws")
    args = ap.parse_args()
    stale = []
    for section, flow in FLOWS.items():
        path = IMAGES / f"flow-{section}.svg"
        svg = draw(flow)
        if path.exists() and path.read_text(encoding="utf-8") == svg:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(svg, encoding="utf-8")
            print(f"wrote {path.relative_to(IMAGES.parent.parent)}")
    if stale:
        sys.exit(f"{', '.join(stale)}: out of date; run python docs/diagrams.py")


if __name__ == "__main__":
    main()
