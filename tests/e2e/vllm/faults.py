"""The e2e run's fault cases, each on a fresh prefill, decode and proxy:

- `decode-dies`: the decode server is killed (SIGKILL, its whole process group) while requests
  are in flight, and prefills it never fetched are waiting for it. Every client request ends
  (an error, never a hang); the prefill keeps serving requests of its own; it frees the blocks
  it held for the dead decode within its KV lease; a decode started again on the same ports
  serves the prompts with the reference's tokens.
- `prefill-dies`: the prefill server is killed after it prefilled requests whose KV the decode
  has not read, and while a batch is in flight. Every decode request ends (an error, or tokens
  equal to the reference's if vLLM recomputed); a prefill started again makes the pair serve
  again with the reference's tokens.
- `plugin-missing`: a server whose NIXL_PLUGIN_DIR holds no such plugin fails at start-up,
  within the ready timeout, with a message naming the backend.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

from servers import Process, ServerFailed, metric_sum, metrics, role_cpus


def _post(url: str, body: dict, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:300]}
    except (urllib.error.URLError, OSError, ValueError) as e:
        return 0, {"error": f"{type(e).__name__}: {e}"}


def _prefill_only(p_url: str, prompt: list[int], model: str) -> dict | None:
    status, answer = _post(p_url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }, timeout=120)
    return answer.get("kv_transfer_params") if status == 200 else None


class Pair:
    """A prefill, a decode and the proxy for one backend, restartable on the same ports."""

    def __init__(self, s, backend: str, case: str):
        from run_e2e import backend_env, free_port, nixl_kv_config, start_proxy, vllm_argv, \
            base_env

        self.s, self.backend, self.case = s, backend, case
        self._argv, self._base_env = vllm_argv, base_env
        self.ports = {"prefill": free_port(), "decode": free_port()}
        self.side = {"prefill": free_port(), "decode": free_port()}
        self.fabric = {"prefill": free_port(), "decode": free_port()}
        self.kv = {"prefill": nixl_kv_config(s, backend, "kv_producer"),
                   "decode": nixl_kv_config(s, backend, "kv_consumer")}
        self.env = {role: backend_env(s, backend, self.fabric[role]) for role in self.ports}
        self.procs: dict[str, Process] = {}
        self._start_proxy = start_proxy

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def start(self, role: str) -> Process:
        env = self._base_env()
        env.update(self.env[role])
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side[role])
        p = Process(f"fault-{self.case}-{role}", self._argv(self.s, self.ports[role],
                                                            self.kv[role]),
                    env, self.s.logs / f"fault-{self.case}-{role}.log",
                    self.url(role) + "/v1/models", cpus=role_cpus(role)).start()
        self.procs[role] = p
        return p

    def start_all(self) -> None:
        for role in ("prefill", "decode"):
            self.start(role)
        for role in ("prefill", "decode"):
            self.procs[role].wait_ready(self.s.ready_timeout)
        proxy, port = self._start_proxy(self.s, f"fault-{self.case}-proxy",
                                        self.ports["prefill"], self.ports["decode"])
        proxy.wait_ready(30)
        self.procs["proxy"] = proxy
        self.proxy_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


def _batch_then_kill(pair: Pair, victim: str, prompts, max_tokens: int, delay_s: float,
                     bound_s: float) -> tuple[list, float]:
    """Sends the prompts through the proxy, kills `victim` after delay_s, returns the answers
    and how long the last one took to end (the client bound is bound_s)."""
    from run_e2e import complete_all

    async def go():
        task = asyncio.ensure_future(
            complete_all(pair.proxy_url, prompts, max_tokens, len(prompts), timeout_s=bound_s))
        await asyncio.sleep(delay_s)
        pair.procs[victim].kill()
        return await task

    t0 = time.monotonic()
    answers, _ = asyncio.run(go())
    return answers, time.monotonic() - t0


def _serves_again(pair: Pair, reference, problems: list[str], what: str,
                  settle_s: float = 90.0) -> int:
    """Once one request goes through (vLLM backs off from a peer that failed, for a while),
    the prompts through the proxy must give the reference's tokens."""
    from run_e2e import run_requests

    t0 = time.monotonic()
    while time.monotonic() - t0 < settle_s:
        probe, _ = run_requests(pair.proxy_url, pair.s.prompts[:1], pair.s.max_tokens, 1)
        if probe[0].tokens is not None:
            break
        time.sleep(2.0)
    else:
        problems.append(f"{what}: no request went through in {settle_s:.0f} s")
        return 0
    pair.settled_s = time.monotonic() - t0
    answers, _ = run_requests(pair.proxy_url, pair.s.prompts, pair.s.max_tokens,
                              pair.s.concurrency)
    same = sum(1 for a, r in zip(answers, reference) if a.tokens == r)
    if same != len(reference):
        bad = next(a for a, r in zip(answers, reference) if a.tokens != r)
        problems.append(f"{what}: {same}/{len(reference)} identical to the reference; first "
                        f"other: {bad.error or bad.tokens}")
    return same


def _case(s, backend: str, name: str, body) -> dict:
    """Runs body(pair, case, problems) on a fresh pair; the pair is stopped whatever happens."""
    case = {"case": name, "backend": backend}
    problems: list[str] = []
    pair = Pair(s, backend, name)
    try:
        pair.start_all()
        body(pair, case, problems)
    except ServerFailed as e:
        problems.append(str(e))
    finally:
        pair.stop()
    if problems:
        case["problems"] = problems
    return case


def _restart_and_serve(pair: Pair, role: str, reference, problems: list[str], case: dict
                       ) -> None:
    """Starts `role` again on its ports; the pair must then serve the reference's tokens."""
    pair.start(role).wait_ready(pair.s.ready_timeout)
    case["identical_after_restart"] = _serves_again(pair, reference, problems,
                                                    f"after the {role} restarted")
    case["served_again_after_s"] = round(getattr(pair, "settled_s", -1), 1)


def decode_dies(s, backend: str, reference) -> dict:
    return _case(s, backend, "decode-dies", lambda *a: _decode_dies(s, reference, *a))


def _decode_dies(s, reference, pair: Pair, case: dict, problems: list[str]) -> None:
    from run_e2e import run_requests, wait_kv_idle

    p_url = pair.url("prefill")
    idle = metric_sum(metrics(p_url + "/metrics"), "vllm:kv_cache_usage_perc")
    # Prefills the decode will never fetch: the prefill holds their blocks for it.
    held = [_prefill_only(p_url, p, "tiny") for p in s.prompts[:4]]
    if not all(held):
        problems.append("prefill-only requests to the prefill server failed")
    held_usage = metric_sum(metrics(p_url + "/metrics"), "vllm:kv_cache_usage_perc")
    bound = 120.0
    answers, took = _batch_then_kill(pair, "decode", s.prompts, 64, 1.0, bound)
    ended_badly = [a for a in answers if a.tokens is None]
    case["in_flight"] = len(answers)
    case["failed_in_flight"] = len(ended_badly)
    case["first_error"] = ended_badly[0].error[:300] if ended_badly else None
    case["last_ended_s"] = round(took, 1)
    if took >= bound:
        problems.append(f"requests in flight when the decode died did not end within "
                        f"{bound:.0f} s")
    # The prefill serves on its own (no KV transfer asked for): the reference's tokens.
    own, _ = run_requests(p_url, s.prompts[:4], s.max_tokens, 4)
    if [a.tokens for a in own] != reference[:4]:
        problems.append(f"the prefill server stopped serving after the decode died: "
                        f"{[a.error for a in own if a.tokens is None][:1]}")
    freed, usage, waited = wait_kv_idle(p_url, idle, timeout_s=3.0 * s.kv_lease_s + 30)
    case.update(prefill_kv_idle=idle, prefill_kv_held=held_usage, prefill_kv_after=usage,
                prefill_kv_freed_s=round(waited, 1))
    if held_usage <= idle:
        problems.append("the prefill-only requests held no KV on the prefill: the case "
                        "tests nothing")
    if not freed:
        problems.append(f"the prefill still holds KV ({usage:.4f}, idle {idle:.4f}) "
                        f"{waited:.0f} s after the decode died (lease {s.kv_lease_s} s)")
    _restart_and_serve(pair, "decode", reference, problems, case)
    case["summary"] = (f"{len(ended_badly)}/{len(answers)} in-flight requests failed, all "
                       f"ended in {took:.0f} s; prefill KV freed {waited:.0f} s later; "
                       f"{case['identical_after_restart']}/{len(reference)} identical after "
                       "restart")


def prefill_dies(s, backend: str, reference) -> dict:
    return _case(s, backend, "prefill-dies", lambda *a: _prefill_dies(s, reference, *a))


def _prefill_dies(s, reference, pair: Pair, case: dict, problems: list[str]) -> None:
    p_url, d_url = pair.url("prefill"), pair.url("decode")
    staged = [(i, _prefill_only(p_url, s.prompts[i], "tiny")) for i in range(4)]
    pair.procs["prefill"].kill()
    bound = 120.0
    ended = []
    t0 = time.monotonic()
    for i, params in staged:
        if params is None:
            problems.append(f"prefill-only request {i} failed")
            continue
        status, answer = _post(d_url + "/v1/completions", {
            "model": "tiny", "prompt": s.prompts[i], "max_tokens": s.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "kv_transfer_params": params}, timeout=bound)
        tokens = (answer.get("choices") or [{}])[0].get("token_ids") if status == 200 \
            else None
        ended.append((i, status, tokens))
        if status == 0:
            problems.append(f"decode request {i} whose prefill died did not end within "
                            f"{bound:.0f} s: {answer.get('error')}")
        elif status == 200 and tokens != reference[i]:
            problems.append(f"decode request {i} whose prefill died answered other tokens "
                            f"than the reference: {tokens}")
    took = time.monotonic() - t0
    case["staged"] = [{"prompt": i, "status": st, "recomputed": t is not None}
                      for i, st, t in ended]
    pair.start("prefill").wait_ready(s.ready_timeout)
    # Now a batch in flight when the prefill dies again.
    answers, took2 = _batch_then_kill(pair, "prefill", s.prompts, s.max_tokens, 1.0, bound)
    if took2 >= bound:
        problems.append(f"requests in flight when the prefill died did not end within "
                        f"{bound:.0f} s")
    wrong = [i for i, (a, r) in enumerate(zip(answers, reference))
             if a.tokens is not None and a.tokens != r]
    if wrong:
        problems.append(f"{len(wrong)} requests answered other tokens than the reference "
                        f"after the prefill died (first prompt {wrong[0]})")
    case["failed_in_flight"] = sum(1 for a in answers if a.tokens is None)
    case["first_error"] = next((a.error[:300] for a in answers if a.tokens is None), None)
    _restart_and_serve(pair, "prefill", reference, problems, case)
    case["summary"] = (f"{len(ended)} staged decode requests ended in {took:.0f} s "
                       f"({sum(1 for _, st, _ in ended if st != 200)} errors); "
                       f"{case['failed_in_flight']}/{len(answers)} in flight failed, all "
                       f"ended in {took2:.0f} s; {case['identical_after_restart']}/"
                       f"{len(reference)} identical after restart")


def _wheel_plugin_dir(python: str) -> Path | None:
    import subprocess

    code = ("import os, nixl._api as a; d = os.path.dirname(a.__file__); "
            "print(os.path.join(os.path.dirname(d), '.' + os.path.basename(d) + "
            "'.mesonpy.libs', 'plugins'))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    path = Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout else None
    return path if path is not None and path.is_dir() else None


def plugin_missing(s, backend: str) -> dict:
    """Two ways of not finding the plugin: NIXL_PLUGIN_DIR naming an empty folder, and one
    holding the other plugins (UCX) but not this one. Either way the server must stop at
    start-up, with NIXL saying what is missing, not serve without the backend or hang."""
    from run_e2e import base_env, free_port, nixl_kv_config, vllm_argv

    case = {"case": "plugin-missing", "backend": backend, "variants": []}
    empty = s.logs / "plugin-dir-empty"
    others = s.logs / f"plugin-dir-without-{backend.lower()}"
    for d in (empty, others):
        d.mkdir(parents=True, exist_ok=True)
    wheel_dir = _wheel_plugin_dir(s.python)
    if wheel_dir is not None:
        for f in wheel_dir.glob("libplugin_*.so"):
            link = others / f.name
            if f.name != f"libplugin_{backend}.so" and not link.exists():
                link.symlink_to(f)
    problems = []
    for label, folder in (("empty folder", empty), (f"folder without {backend}", others)):
        env = base_env()
        env.update(NIXL_PLUGIN_DIR=str(folder), VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        port = free_port()
        log = s.logs / f"fault-plugin-missing-{'empty' if folder == empty else 'others'}.log"
        p = Process("fault-plugin-missing", vllm_argv(s, port, nixl_kv_config(s, backend,
                                                                             "kv_consumer")),
                    env, log, f"http://127.0.0.1:{port}/v1/models").start()
        t0 = time.monotonic()
        variant = {"variant": label}
        try:
            p.wait_ready(s.ready_timeout)
            problems.append(f"a server whose NIXL_PLUGIN_DIR is an {label} ({folder}) started")
        except ServerFailed as e:
            text = log.read_text(errors="replace")
            # NIXL's words for it (docs/nixl.md, "When NIXL does not find it").
            said = [ln for ln in text.splitlines()
                    if "No plugins available" in ln or "missing plugin" in ln
                    or "unsupported backend" in ln or "NIXL_ERR_NOT_FOUND" in ln]
            variant["message"] = said[0][-300:] if said else None
            variant["stopped_after_s"] = round(time.monotonic() - t0, 1)
            if "exited" not in str(e):
                problems.append(f"{label}: {str(e).splitlines()[0]}")
            if not said:
                problems.append(f"{label}: the server stopped without NIXL saying the plugin is "
                                f"missing; its log ends:\n{p.tail(15)}")
        finally:
            p.stop()
        case["variants"].append(variant)
    case["summary"] = "; ".join(f"{v['variant']}: stopped after {v.get('stopped_after_s')} s, "
                                f"{v.get('message')!r}" for v in case["variants"])
    if problems:
        case["problems"] = problems
    return case


CASES = ("decode-dies", "prefill-dies", "plugin-missing")


def run_faults(s, backend: str, reference, cases=CASES) -> list[dict]:
    out = []
    for case in cases:
        if case == "decode-dies":
            out.append(decode_dies(s, backend, reference))
        elif case == "prefill-dies":
            out.append(prefill_dies(s, backend, reference))
        elif case == "plugin-missing":
            out.append(plugin_missing(s, backend))
        else:
            raise ValueError(f"unknown fault case {case!r}: one of {', '.join(CASES)}")
    return out
