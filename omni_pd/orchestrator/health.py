"""What the orchestrator reports about itself: each stage's and replica's health (the server's
/health), the P/D links' breakers, and the per-request state every side holds (/debug/state)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .breaker import CircuitBreaker
from .replicas import StagePool
from .stage_client import StageClient, StageError

CONTROL_TIMEOUT_S = 5.0  # a stage that does not answer a state query within this is reported


async def debug_state_counts(requests: int, pools: Mapping[int, StagePool]) -> dict[str, int]:
    """Per-request state on every side: all zero when no request is in flight. Keys name the
    stage (`stage0.`), and the replica where a stage has several (`stage0.r1.`); one that
    cannot answer (restarting, down, frozen) shows as `<that>.unreachable: 1`."""
    counts = {
        "orchestrator.requests": requests,
        "orchestrator.replica_assignments": sum(sum(pool.in_flight) for pool in pools.values()),
    }
    for stage_id, pool in list(pools.items()):
        for client in pool.clients:
            try:
                answer = await client.control_async("debug_state_counts", CONTROL_TIMEOUT_S)
            except StageError:
                counts[f"{client.tag}.unreachable"] = 1
                continue
            for key, value in answer.items():
                counts[f"{client.tag}.{key}"] = value
    return counts


def _replica_health(client: StageClient) -> dict[str, Any]:
    why = client.unavailable()
    return {
        "status": client.status.value,
        "responsive": why is None,
        "restarts": client.restarts,
        "pid": client.process.pid if client.process is not None else None,
        "reason": str(why) if why is not None else "",
    }


def health_report(
    pools: Mapping[int, StagePool],
    stage_name: Callable[[int], str],
    breakers: Mapping[tuple[int, int], CircuitBreaker],
    handoff_failures: int,
    fallbacks: int,
) -> dict[str, Any]:
    """Each stage's status (up, restarting, down, silent) and why, and each replica's with
    its load; "ok" when every worker is up and answering. The server's /health answers 503
    unless ok, though a stage with one replica up still serves."""
    stages: dict[str, Any] = {}
    for stage_id, pool in pools.items():
        replicas = [{**_replica_health(c), "load": pool.load(k)} for k, c in enumerate(pool.clients)]
        worst = next((r for r in replicas if not r["responsive"]), replicas[0])
        stages[str(stage_id)] = {
            "name": stage_name(stage_id),
            "status": worst["status"],
            "responsive": all(r["responsive"] for r in replicas),
            "serving": any(r["responsive"] for r in replicas),
            "restarts": sum(r["restarts"] for r in replicas),
            "pid": replicas[0]["pid"],
            "reason": "; ".join(
                f"replica {k}: {r['reason']}" if len(replicas) > 1 else r["reason"]
                for k, r in enumerate(replicas)
                if r["reason"]
            ),
            "replicas": replicas,
        }
    report: dict[str, Any] = {
        "status": "ok" if all(s["responsive"] for s in stages.values()) else "degraded",
        "stages": stages,
    }
    if breakers:
        states = {f"p{p}->d{d}": b.state.value for (p, d), b in breakers.items()}
        worst_state = next((v for v in states.values() if v != "closed"), "closed")
        report["kv_handoff"] = {
            "breaker": worst_state,
            "breakers": states,
            "failures": handoff_failures,
            "fallbacks": fallbacks,
        }
    return report
