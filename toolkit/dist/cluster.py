"""The expert ranks as Ray actors and the hop of each MoE layer between the driver and them.

``Cluster`` starts ``N`` :class:`toolkit.dist.rank.ExpertRank` actors in a placement group (one bundle per rank,
spread over the Ray cluster's nodes; ``num_gpus=1`` each when the ranks compute on a GPU), each loading its own
experts. A layer's hop (``call``) sends each rank the rows routed to its experts, waits for every answer (with a
timeout) and sums them into ``[T, D]``. The transport (``EPSpec.transport``):

- ``"graph"`` (default): one Ray Compiled Graph (rank ``r``'s ``run`` bound to argument ``r`` of the input, all
  outputs gathered; every rank gets a message each hop): the least fixed cost per hop (measured here: 0.8-1.4 ms
  against 1.3-2.9 ms), but Ray's channel reads spin: every rank and the driver hold a core at 100 % while they
  wait, between requests too.
- ``"calls"``: one Ray actor call per rank that has rows (a rank with none is not asked). Waiting costs no CPU:
  the ranks and the driver sleep between hops.

Faults: a rank lost during a hop (its process killed, its node gone) or silent past the timeout ends that call with
a :class:`RankError` naming the rank, its process and the layer; the compiled graph (if any) is torn down, Ray
restarts the rank (it reloads its experts), and the next call waits for every rank to answer (up to
``load_timeout``) and compiles the graph again. A rank that cannot load fails the start with its reason.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import ToolkitError

# environment a rank started on this machine needs as the driver has it (Ray's local workers start from the raylet)
PASS_ENV = ("PYTHONPATH", "NUMBA_CACHE_DIR", "MOQE_CACHE_DIR", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS",
            "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
HOP_SAMPLES = 4096  # hop times kept for medians
TRANSPORTS = ("calls", "graph")
RETRY_S = 0.2  # between asks to a rank Ray is restarting


class RankError(ToolkitError, RuntimeError):
    """An expert rank failed: lost, silent past its timeout, or unable to load."""


@dataclass(frozen=True)
class EPSpec:
    """Expert parallelism as the user asks for it (``--ep N [--ray-address ADDR] [--ep-split TRACE]``)."""

    ranks: int
    address: str | None = None  # a Ray cluster's address; None: a local Ray started on demand
    split: str | None = None  # a routing trace (``moqe trace``) to balance the split by; None: contiguous
    cpus: int = 1  # CPUs each rank asks for (its kernels' threads)
    timeout: float = 120.0  # seconds a hop may take before its ranks are declared silent
    load_timeout: float = 900.0  # seconds the ranks may take to load (and to come back after a restart)
    restarts: int = 8  # times Ray restarts a lost rank
    fail: tuple = ()  # tests: (rank, reason): that rank's start fails with reason
    transport: str = "graph"  # "graph" (Ray Compiled Graph: least time a hop; waits spin) or "calls" (actor calls)

    def __post_init__(self):
        if int(self.ranks) < 1:
            raise ToolkitError(f"--ep must be at least 1, got {self.ranks}")
        if self.transport not in TRANSPORTS:
            raise ToolkitError(f"--ep-transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")


class Cluster:
    """``N`` expert ranks on Ray and the compiled graph of a layer's hop. ``stats`` counts hops, bytes and time."""

    def __init__(self, spec: EPSpec, source: str, split, E: int, D: int, backend: str = "numba", policy=None,
                 activations=None, allow_outside: bool = False):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..backend import capabilities
        from .rank import ExpertRank

        self.spec, self.split, self.E, self.D = spec, split, E, D
        self.N = N = split.ranks
        self.started_ray = False
        if not ray.is_initialized():
            if spec.address:
                ray.init(address=spec.address, log_to_driver=False, logging_level="ERROR")
            else:
                # logical CPUs for two runs' ranks (perplexity --kld: the full-precision reference beside the
                # model) and the driver: on one machine the ranks share its cores, as --ep N asked
                ray.init(num_cpus=max(os.cpu_count() or 1, 2 * N * spec.cpus + 1), include_dashboard=False,
                         log_to_driver=False, logging_level="ERROR")
            self.started_ray = True
        self.ray = ray
        gpus = 1 if capabilities(backend).on_device and backend == "cuda" else 0
        bundle = {"CPU": spec.cpus, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([bundle] * N, strategy="SPREAD")
        try:
            ray.get(self.pg.ready(), timeout=min(spec.load_timeout, 120))
        except Exception as e:
            self._release()
            raise RankError(f"the Ray cluster cannot place {N} expert rank(s) of {bundle} each "
                            f"({type(e).__name__}); available: {ray.available_resources()}") from None
        env = {k: os.environ[k] for k in PASS_ENV if k in os.environ} if not spec.address else {}
        fails = dict(spec.fail)
        actor = ray.remote(ExpertRank)
        self.actors = []
        for r in range(N):
            opts = dict(num_cpus=spec.cpus, num_gpus=gpus, max_restarts=spec.restarts, max_task_retries=0,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r))
            if env:
                opts["runtime_env"] = {"env_vars": env}
            self.actors.append(actor.options(**opts).remote(
                str(source), r, split.rank_ids(r), E, backend, policy, activations, allow_outside, spec.cpus,
                fails.get(r)))
        self.infos: list[dict] = [{} for _ in range(N)]
        self.dag = None
        self.ready = False
        self.stats = {"hops": 0, "seconds": 0.0, "bytes_out": 0, "bytes_in": 0}
        self.hop_s: deque = deque(maxlen=HOP_SAMPLES)  # the latest hops' seconds, send to sum (the bench's medians)
        atexit.register(self.close)

    # ---- start, restart --------------------------------------------------------------------------------
    def wait_ready(self) -> list[dict]:
        """Wait for every rank to have loaded (``load_timeout``), then compile the hop's graph; a rank that failed
        to load raises :class:`RankError` with its reason."""
        ray = self.ray
        deadline = time.monotonic() + self.spec.load_timeout
        for r, a in enumerate(self.actors):
            while True:
                try:
                    self.infos[r] = ray.get(a.info.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.GetTimeoutError:
                    raise RankError(f"expert rank {r} did not finish loading its experts within "
                                    f"{self.spec.load_timeout:.0f} s") from None
                except ray.exceptions.ActorUnavailableError:  # restarting after a loss: ask again until the deadline
                    if time.monotonic() > deadline:
                        raise RankError(f"expert rank {r} did not come back within {self.spec.load_timeout:.0f} s") from None
                    time.sleep(RETRY_S)
                except Exception as e:
                    raise RankError(f"expert rank {r} could not load its experts: {_cause(e)}") from None
        if self.spec.transport == "graph":
            self._compile()
        self.ready = True
        return self.infos

    def refresh(self) -> list[dict]:
        """Every rank's ``info()`` now (its peak resident set so far), within ``timeout``. An actor of a compiled
        graph runs nothing else: the graph is torn down first, and the next hop compiles it again."""
        if self.dag is not None:
            self._teardown()
        self.infos = self.ray.get([a.info.remote() for a in self.actors], timeout=self.spec.timeout)
        return self.infos

    def _compile(self):
        from ray.dag import InputNode, MultiOutputNode

        from .rank import numpy_channels

        numpy_channels()
        with InputNode() as inp:
            dag = MultiOutputNode([a.run.bind(inp[r]) for r, a in enumerate(self.actors)])
        self.dag = dag.experimental_compile(_submit_timeout=self.spec.timeout)

    def _teardown(self):
        if self.dag is not None:
            log = logging.getLogger("ray.dag.compiled_dag_node")  # its traceback for a dead actor: said by RankError
            level = log.level
            log.setLevel(logging.CRITICAL)
            try:
                self.dag.teardown()
            except Exception:  # a graph whose actor died tears down what it can
                pass
            finally:
                log.setLevel(level)
            self.dag = None
        self.ready = False

    # ---- the hop ------------------------------------------------------------------------------------
    def call(self, layer: int, x: np.ndarray, ids: np.ndarray, wts: np.ndarray, every: bool = False) -> np.ndarray:
        """Layer ``layer``'s routed experts for ``x [T, D]`` routed to ``ids [T, A]`` with ``wts [T, A]`` -> ``[T, D]``.
        ``every``: ask every rank, also those without rows (the bench's empty hop: the round trip alone)."""
        if not self.ready:
            self.wait_ready()
        T = x.shape[0]
        own = self.split.owner[layer][ids]  # [T, A] the rank of each slot
        rows, msgs = [], []
        for r in range(self.N):
            rr = np.flatnonzero((own == r).any(1))  # [n_r] the tokens this rank has a slot of
            rows.append(rr)
            msgs.append((layer, np.ascontiguousarray(x[rr]), np.ascontiguousarray(ids[rr]), np.ascontiguousarray(wts[rr])))
        t0 = time.perf_counter()
        if self.dag is not None:
            try:
                outs = self.ray.get(self.dag.execute(*msgs), timeout=self.spec.timeout)
            except Exception as e:
                raise self._lost(layer, e) from None
        else:
            outs = self._calls(layer, rows, msgs, every)
        dt = time.perf_counter() - t0
        self.stats["seconds"] += dt
        self.hop_s.append(dt)
        self.stats["hops"] += 1
        self.stats["bytes_out"] += sum(m[1].nbytes + m[2].nbytes + m[3].nbytes for m in msgs)
        self.stats["bytes_in"] += sum(o.nbytes for o in outs if o is not None)
        y = np.zeros((T, self.D), np.float32)
        for rr, o in zip(rows, outs):
            if rr.size:
                y[rr] += o
        return y

    def _calls(self, layer: int, rows, msgs, every: bool = False) -> list:
        """The hop as one actor call per rank that has rows (None for the others), every answer waited for within
        ``timeout`` in all; a lost or silent rank is named by its index."""
        refs = {r: a.run.remote(m) for r, (a, rr, m) in enumerate(zip(self.actors, rows, msgs))
                if rr.size or every}
        outs, deadline = [None] * self.N, time.monotonic() + self.spec.timeout
        for r, ref in refs.items():
            try:
                outs[r] = self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                for other in refs.values():  # the rest of this hop is not waited for
                    try:
                        self.ray.cancel(other)
                    except Exception:  # done already, or its actor gone
                        pass
                raise self._lost(layer, e, r) from None
        return outs

    def _lost(self, layer: int, e: Exception, rank: int | None = None) -> RankError:
        """The error of a failed hop, naming the rank (``rank``, or found in a graph's error by actor id); the graph
        torn down for the next call to rebuild."""
        self._teardown()
        text = str(e)
        which = [rank] if rank is not None else [r for r, a in enumerate(self.actors) if a._actor_id.hex() in text]
        timeout = "Timeout" in type(e).__name__
        if not which:
            which = list(range(self.N))
        names = ", ".join(f"{r} (pid {self.infos[r].get('pid', '?')} on {self.infos[r].get('host', '?')})" for r in which)
        what = f"did not answer within {self.spec.timeout:.0f} s" if timeout else "was lost"
        return RankError(f"expert rank {names} {what} during layer {layer} ({type(e).__name__}); this request is "
                         f"ended. Ray restarts a lost rank, which reloads its experts; the next request waits for it "
                         f"(up to {self.spec.load_timeout:.0f} s)")

    # ---- end ----------------------------------------------------------------------------------------
    def close(self):
        if getattr(self, "actors", None) is None:
            return
        self._teardown()
        for a in self.actors:
            try:
                self.ray.kill(a)
            except Exception:
                pass
        self.actors = None
        self._release()

    def _release(self):
        try:
            self.ray.util.remove_placement_group(self.pg)
        except Exception:
            pass
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def _cause(e: Exception) -> str:
    """The innermost message of a Ray error (an actor's constructor's exception), one line."""
    cause = getattr(e, "cause", None) or getattr(e, "__cause__", None)
    text = str(cause if cause is not None else e)
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else type(e).__name__
