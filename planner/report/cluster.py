"""The cluster as a graph (networkx): devices grouped by server, coloured by pipeline stage,
with the chosen plan's tensor-, pipeline- and data-parallel groups as edges.

Rank layout is planner/specs/mesh.py's (Plan.rank): rank = (pp_index * dp + dp_index) * tp + tp_index,
and rank r sits on server r // gpus_per_node, slot r % gpus_per_node (the launcher's
hostfile order). Large clusters draw two data-parallel replicas: every replica has the same
shape, and thousands of dots show nothing.
"""
from __future__ import annotations

from typing import Any

import matplotlib
import networkx as nx
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch

from planner.report.plots import render
from planner.specs import Plan

MAX_RANKS = 128
"""Draw every rank up to this many; beyond, data-parallel replicas 0 and 1 only."""


def build_graph(plan: Plan, gpus_per_node: int, max_ranks: int = MAX_RANKS) -> tuple[nx.Graph, dict[str, Any]]:
    """Nodes are ranks (attributes server, slot, stage, dp, tp); edges carry kind tp|pp|dp."""
    world = plan.world_size
    replicas = plan.dp if world <= max_ranks else min(plan.dp, 2)
    stages = plan.pp
    while replicas * plan.tp * stages > max_ranks and stages > 2:
        stages -= 1                                   # very deep pipelines: first stages only
    g = nx.Graph()
    for s in range(stages):
        for d in range(replicas):
            for t in range(plan.tp):
                r = plan.rank(pp=s, dp=d, tp=t)
                g.add_node(r, server=r // gpus_per_node, slot=r % gpus_per_node, stage=s, dp=d, tp=t)
    for s in range(stages):
        for d in range(replicas):
            for t in range(plan.tp):
                r = plan.rank(pp=s, dp=d, tp=t)
                if t + 1 < plan.tp:
                    g.add_edge(r, plan.rank(pp=s, dp=d, tp=t + 1), kind="tp")
                if s + 1 < stages:
                    g.add_edge(r, plan.rank(pp=s + 1, dp=d, tp=t), kind="pp")
                if d + 1 < replicas:
                    g.add_edge(r, plan.rank(pp=s, dp=d + 1, tp=t), kind="dp")
    info = {"shown_ranks": g.number_of_nodes(), "world": world, "replicas_shown": replicas, "dp": plan.dp,
            "stages_shown": stages, "pp": plan.pp,
            "servers": sorted({a["server"] for _, a in g.nodes(data=True)})}
    return g, info


def draw_cluster(plan: Plan, gpus_per_node: int, nodes: int) -> tuple[str, dict[str, Any]]:
    g, info = build_graph(plan, gpus_per_node)
    servers = info["servers"]
    column = {s: i for i, s in enumerate(servers)}
    pos = {r: (column[a["server"]] * 1.6, -a["slot"]) for r, a in g.nodes(data=True)}
    cmap = matplotlib.colormaps["viridis" if plan.pp > 10 else "tab10"]
    color = [cmap(a["stage"] / max(1, plan.pp - 1) if plan.pp > 10 else a["stage"] % 10) for _, a in g.nodes(data=True)]
    many = g.number_of_nodes() > 48

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        ax.set_axis_off()
        for s in servers:
            x = column[s] * 1.6
            ax.add_patch(FancyBboxPatch((x - 0.45, -(gpus_per_node - 1) - 0.4), 0.9, gpus_per_node - 1 + 0.8,
                                        boxstyle="round,pad=0.08", fc="#f4f4f4", ec="#999", lw=0.8))
            ax.text(x, 0.6, f"server {s}", ha="center", va="bottom", fontsize=7, color="#333")
        styles = {"tp": {"edge_color": "#222", "width": 2.6, "style": "solid"},
                  "pp": {"edge_color": "#dd8452", "width": 1.2, "style": "solid"},
                  "dp": {"edge_color": "#4c72b0", "width": 1.0, "style": "dashed"}}
        for kind, st in styles.items():
            edges = [(u, v) for u, v, k in g.edges(data="kind") if k == kind]
            if edges:
                curved = {"arrows": True, "arrowstyle": "-", "connectionstyle": "arc3,rad=0.25",
                          "node_size": 110 if many else 260} if kind != "tp" and len(edges) <= 200 else {"arrows": False}
                nx.draw_networkx_edges(g, pos, edgelist=edges, ax=ax, alpha=0.8, **curved, **st)
        nx.draw_networkx_nodes(g, pos, ax=ax, node_color=color, node_size=110 if many else 260,
                               edgecolors="black", linewidths=0.6)
        if not many:
            nx.draw_networkx_labels(g, pos, ax=ax, font_size=6, font_color="white")
        handles = [Line2D([], [], color="#222", lw=2.6, label=f"TP group ({plan.tp} ranks)"),
                   Line2D([], [], color="#dd8452", lw=1.2, label=f"PP: next stage ({plan.pp} stages)"),
                   Line2D([], [], color="#4c72b0", lw=1.0, ls="--", label=f"DP: same shard ({plan.dp} replicas)")]
        stages = sorted({a["stage"] for _, a in g.nodes(data=True)})
        if len(stages) > 10:
            handles += [Line2D([], [], marker="o", ls="", color=cmap(s / max(1, plan.pp - 1)), markeredgecolor="black",
                               label=f"stage {s}") for s in (stages[0], stages[len(stages) // 2], stages[-1])]
        else:
            handles += [Line2D([], [], marker="o", ls="", color=cmap(s % 10 if plan.pp <= 10 else s / max(1, plan.pp - 1)),
                               markeredgecolor="black", label=f"stage {s}") for s in stages]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1), frameon=False)
        ax.set_xlim(-0.8, (len(servers) - 1) * 1.6 + 0.8)
        ax.set_ylim(-gpus_per_node + 0.3, 1.1)

    width = min(10.5, 3.2 + 0.75 * len(servers))
    height = min(6.5, 1.4 + 0.42 * gpus_per_node)
    info["nodes"] = nodes
    return render(draw, (width, height)), info


__all__ = ["build_graph", "draw_cluster"]
