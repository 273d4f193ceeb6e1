"""The engine process: a busy loop while there is work, blocking when idle.

Started by the API process (`python -m replica.engine.process --socket PATH
--config JSON`); connects back over a Unix socket and speaks length-prefixed
msgspec frames (wire.protocol.FrameCodec). No asyncio: one thread that
  1. takes every message already received (blocking only when idle),
  2. runs one engine step (`replica.engine.containment`: a request that makes it fail
     fails alone, the others go on),
  3. sends the step's tokens, finishes, KV events and load (periodically, and
     after every step that admits, aborts or finishes a request, so the running
     count routers and `/metrics` see is never a report behind); each Load counts the
     Generates taken so far (`taken`: the API process adds those it sent since).
KV transfer commands (KvRead, KvBlocks, KvHot: replica.engine.kv_transfer) are served as they are
taken, between steps (reads up to KV_READ_BYTES a boundary while there are streams, the rest at the
next ones), and answered before the next step runs: under decode load a transfer's
round trip was the wait for the boundary plus a whole step, ~240 ms of the 3 MB frame's
~245 ms (docs/perf.md, drain with hand-off). Their bytes cross in the KV slots the API process
shares with this one (replica.kv_slots, `--kv-slots-fd`): the socket carries their indexes only.
An Abort is therefore applied before the next step: a cancelled request stops
within one step and its blocks are freed. The process exits when the API
process closes the socket, or with it (replica.lifetime: a signal to the whole process group
is the API process's to act on, so a drain's streams keep their engine).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import select
import socket
import sys
import time
from collections import deque

import msgspec

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine.containment import Containment
from replica.engine.kv_transfer import KvTransfer
from replica.lifetime import follow_parent
from replica.stages import Stages


def build_engine(cfg: EngineConfig, stages: Stages | None = None):
    """The engine; with cfg.tp > 1 it is rank 0 and starts ranks 1..tp-1 (replica.model.worker).
    Each stage of the build is said on stderr as it ends (replica.stages)."""
    stages = stages or Stages()
    with stages.stage("building kernels", " (torch, and on CPU the C++ kernels: a first start compiles them, "
                                         "about a minute)"):
        from replica.model.runner import kernel_set

        ops = kernel_set(cfg)
    from replica.engine.llm_engine import LLMEngine
    from replica.model import built
    from replica.model import tp as TP
    from replica.model.loader import load_model_for, prepare_process
    from replica.model.runner import for_device
    from replica.model.worker import spawn_workers
    from replica.tokenizer import Tokenizer

    tokenizer = functools.partial(Tokenizer.from_spec, cfg.model)  # grammars' tokenizer, built in their thread
    # "building engine": the model built from the weights (quantized, packed), the KV pool, decode graphs
    if cfg.tp == 1:
        with stages.stage("loading weights", f" ({cfg.model})"):
            found = built.lookup(cfg, ops)  # a quantized CPU model built by an earlier start
            if found is not None:
                prepare_process(cfg)
                model_cfg, model = found
            else:
                model_cfg, weights = load_model_for(cfg)
        with stages.stage("building engine"):
            if found is not None:
                engine = LLMEngine(cfg, model_cfg, model=for_device(model, cfg), ops=ops, tokenizer=tokenizer)
            else:
                engine = LLMEngine(cfg, model_cfg, weights, ops=ops, tokenizer=tokenizer)
                del weights
                built.keep(cfg, model_cfg, engine.runner.model)
    else:
        with stages.stage("loading weights", f" ({cfg.model})"):
            model_cfg, weights = load_model_for(cfg)
        with stages.stage("building engine"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            workers = spawn_workers(cfg, init_method)
            engine = LLMEngine(cfg, model_cfg, weights, tp=TP.init(0, cfg.tp, init_method, cfg.device),
                               workers=workers, tokenizer=tokenizer)
    with stages.stage("warming up"):
        engine.grammars.warm()
    return engine


def compute_fields(cfg: EngineConfig) -> dict:
    """Hello.compute and Hello.uses: each rank's GPU by its UUID, or the cores this
    engine may run on, named by the running kernel's boot id (the same on every
    container of one machine, unlike a host name), and how many of those cores its
    threads use at once. Replicas whose units meet share them."""
    if cfg.device.startswith("cuda"):
        import torch

        return {"compute": [f"gpu:{torch.cuda.get_device_properties(r).uuid}" for r in range(cfg.tp)], "uses": 0}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = socket.gethostname()
    return {"compute": [f"cpu:{machine}:{c}" for c in sorted(os.sched_getaffinity(0))],
            "uses": cfg.engine_threads()}


# While it has streams, a boundary answers KV reads of at most this many bytes (at least one read), the
# rest at the next boundaries: one of the default model's 8-block frames. A read is a copy from the pool
# into its KV slot (replica.kv_slots; 1-3 ms a 3 MB frame), but each frame read is work for both API
# processes and the receiving engine at once, on the cores the streams' steps need: in a drain on two
# cores (bench/drain.py, 2026-12-03) the longest gap of a moved stream, while A read 3, 6 or 12 MB a
# boundary, was 81-91, 109-149 and 131-151 ms, and every pull still finished in the budget. Idle,
# everything at once.
KV_READ_BYTES = 3 << 20


def serve(engine, sock: socket.socket, replica_id: str, model_name: str, report_interval: float,
          slots_fd: int) -> None:
    codec = P.FrameCodec()
    contained = Containment(engine)
    kv = KvTransfer(engine, slots_fd)  # KV export and import between replicas, the bytes in shared slots
    sock.sendall(codec.pack([P.Hello(replica_id=replica_id, model=model_name, block_size=engine.cfg.block_size,
                                     max_model_len=engine.max_model_len, kv_slots=kv.slots.count,
                                     kv_slot_bytes=kv.slots.slot_bytes, **compute_fields(engine.cfg)), kv.spec]))
    next_report = 0.0
    taken = 0  # Generates taken off the socket: every Load says so (replica.api.queued_load)
    reads: deque[P.KvRead] = deque()  # KV reads taken and not yet answered (`KV_READ_BYTES` a boundary)
    while True:
        busy = engine.has_work()
        timeout = 0.0 if busy else max(0.0, next_report - time.monotonic())
        out: list = []
        kv_out: list = []  # answers to KV transfer commands
        changed = False  # a request came or went: report the load after this step
        readable, _, _ = select.select([sock], [], [], timeout)
        while readable:
            data = sock.recv(1 << 20)
            if not data:
                return  # the API process is gone
            for msg in codec.feed(data):
                changed = True
                if isinstance(msg, P.Generate):
                    taken += 1
                    err = contained.add(msg)
                    if err is not None:
                        out.append(err)
                elif isinstance(msg, P.Abort):
                    fin = engine.abort(msg.id)
                    if fin is not None:
                        out.append(fin)
                elif isinstance(msg, P.KvRead):
                    reads.append(msg)
                elif isinstance(msg, P.KvBlocks):
                    kv_out.append(kv.write(msg))
                elif isinstance(msg, P.KvHot):
                    kv_out.append(kv.hot(msg))
            readable, _, _ = select.select([sock], [], [], 0.0)
        budget = KV_READ_BYTES if engine.has_work() else None
        first = True  # the first read always goes; the next only where its bytes fit what is left
        while reads and (budget is None or first or len(reads[0].hashes) * kv.spec.block_bytes <= budget):
            kv_out.append(kv.read(reads.popleft()))
            first = False
            if budget is not None:
                budget -= len(kv_out[-1].hashes) * kv.spec.block_bytes
        if kv_out:  # answered now, not after the step: a transfer's round trip is the wait for this boundary only
            events = engine.kv_events()  # an import's stored events first: the API's cache mirror has them
            sock.sendall(codec.pack(([events] if events is not None else []) + kv_out))  # before the answer
        if engine.has_work():
            step = contained.step()
            changed = changed or any(type(m) in (P.Finished, P.Error) for m in step)
            out.extend(step)
        events = engine.kv_events()
        if events is not None:
            out.append(events)
        now = time.monotonic()
        if now >= next_report or changed:
            load = engine.load()
            load.taken = taken
            out.append(load)
            next_report = now + report_interval
        if out:
            sock.sendall(codec.pack(out))


def main(argv: list[str] | None = None) -> None:
    follow_parent()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="Unix socket of the API process")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--replica-id", default="replica")
    ap.add_argument("--kv-slots-fd", type=int, required=True,
                    help="the API process's shared segment for KV frames (replica.kv_slots), passed at spawn")
    args = ap.parse_args(argv)
    cfg = msgspec.json.decode(args.config, type=EngineConfig)
    engine = build_engine(cfg)
    gc.freeze()  # the model and its tensors' wrappers: collections between steps scan only new objects
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    try:
        serve(engine, sock, args.replica_id, os.path.basename(cfg.model), cfg.load_report_interval_s,
              args.kv_slots_fd)
    except (BrokenPipeError, ConnectionResetError):
        pass  # API process went away
    finally:
        sock.close()
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
