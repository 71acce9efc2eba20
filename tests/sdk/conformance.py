"""The official `openai` and `anthropic` SDKs through tokentap, against `tokentap sim`.

Every dialect the SDKs speak, streaming and not, with `inject_usage` off and on, plus the
SDKs' view of tokentap's own errors (429 from the queue, 502 from a dead upstream). Each
call's parsed result is checked, and so are tokentap's `/stats` totals at the end. The
Responses helper runs against the simulator directly too.

Run by `.ci/run` through `tests/sdk/run.sh`; `TOKENTAP_BIN` names the binary.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import anthropic
import openai

BIN = os.environ["TOKENTAP_BIN"]
N = 6  # tokens per limited request
DEFAULT = 9  # the simulator's tokens when a request sets no limit
TOK = " tok"

procs = []
checks = 0


def check(cond, what):
    global checks
    checks += 1
    if not cond:
        raise AssertionError(what)


def free_port():
    """A free port below the kernel's ephemeral range (32768 and up), so that no outgoing
    connection takes it before the process it is meant for binds it."""
    import random
    while True:
        port = random.randrange(10_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def wait_port(port, proc, what):
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"{what} exited: {proc.returncode}: {err[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on {port}")


def spawn(args, port, what):
    p = subprocess.Popen([BIN, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs.append(p)
    wait_port(port, p, what)
    return p


def sim(dialect, tpot_ms=1.0):
    port = free_port()
    spawn(
        ["sim", "--listen", f"127.0.0.1:{port}", "--dialect", dialect, "--ttft-ms", "2",
         "--tpot-curve", f"1:{tpot_ms},128:{tpot_ms}", "--max-tokens", str(DEFAULT)],
        port,
        f"sim {dialect}",
    )
    return port


def proxy(config, tmp, name):
    proxy_port, admin_port = free_port(), free_port()
    path = os.path.join(tmp, f"{name}.toml")
    with open(path, "w") as f:
        f.write(f'[listen]\nproxy = "127.0.0.1:{proxy_port}"\nadmin = "127.0.0.1:{admin_port}"\n')
        f.write(config)
    spawn(["run", "--config", path], proxy_port, f"tokentap {name}")
    wait_port(admin_port, procs[-1], f"tokentap {name} admin")
    return proxy_port, admin_port


def stats(admin_port):
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats") as r:
        return {u["name"]: u for u in json.load(r)["upstreams"]}


def wait_idle(admin_port):
    """The proxy records a request just after its last byte: wait until nothing is in flight."""
    deadline = time.time() + 10
    while time.time() < deadline:
        if all(u["in_flight"] == 0 for u in stats(admin_port).values()):
            return
        time.sleep(0.02)
    raise AssertionError("requests still in flight")


def chat_suite(client, expect_usage_chunk_when_asked):
    """Chat and legacy completions, streaming and not; returns the tokens generated."""
    produced = 0
    msgs = [{"role": "user", "content": "hello"}]

    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=N)
    check(r.choices[0].message.content == TOK * N, f"chat content {r.choices[0].message.content!r}")
    check(r.choices[0].finish_reason == "length", "chat finish_reason length")
    check(r.usage.completion_tokens == N, "chat usage")
    produced += N

    r = client.chat.completions.create(model="m", messages=msgs)
    check(r.choices[0].finish_reason == "stop", "chat without a limit stops")
    check(r.usage.completion_tokens == DEFAULT, "chat usage, no limit")
    produced += DEFAULT

    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=N, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check(text == TOK * N, f"streamed chat text {text!r}")
    check(all(c.choices for c in chunks), "no usage-only chunk the client did not ask for")
    check(chunks[-1].choices[0].finish_reason == "length", "streamed finish_reason")
    produced += N

    chunks = list(client.chat.completions.create(
        model="m", messages=msgs, max_tokens=N, stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if c.usage is not None]
    check(len(usage) == 1 and usage[0].completion_tokens == N, f"include_usage chunk {usage}")
    check(chunks[-1].choices == [], "the usage chunk comes last, with no choices")
    produced += N

    # The SDK's stream helper (which refuses a completion cut by its length limit).
    with client.chat.completions.stream(model="m", messages=msgs) as s:
        final = s.get_final_completion()
    check(final.choices[0].message.content == TOK * DEFAULT, "chat.completions.stream final")
    check(final.choices[0].finish_reason == "stop", "chat.completions.stream stop")
    produced += DEFAULT

    r = client.completions.create(model="m", prompt="hi", max_tokens=N)
    check(r.choices[0].text == TOK * N, "legacy completion")
    produced += N
    chunks = list(client.completions.create(model="m", prompt="hi", max_tokens=N, stream=True))
    check("".join(c.choices[0].text for c in chunks if c.choices) == TOK * N, "legacy streamed")
    produced += N

    models = client.models.list()
    check([m.id for m in models.data] == ["tokentap-sim"], "models.list")
    return produced


def responses_suite(client):
    produced = 0
    with client.responses.stream(model="m", input="hello") as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    check(final.status == "completed", "no limit: completed")
    check(final.output_text == TOK * DEFAULT, f"responses.stream output_text {final.output_text!r}")
    check(final.usage.output_tokens == DEFAULT, "responses usage")
    want = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"]
    check([k for k in kinds if k in want and k != "response.output_text.delta"]
          == [k for k in want if k != "response.output_text.delta"], f"event order {kinds}")
    check(kinds.count("response.output_text.delta") == DEFAULT, "one delta per token")
    produced += DEFAULT

    # Ended by max_output_tokens: `response.incomplete` (the SDK gives no final response
    # for it, as against the real API).
    with client.responses.stream(model="m", input="hello", max_output_tokens=N) as s:
        events = list(s)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check(text == TOK * N, f"limited stream text {text!r}")
    check(events[-1].type == "response.incomplete", f"last event {events[-1].type}")
    check(events[-1].response.incomplete_details.reason == "max_output_tokens", "reason")
    produced += N

    r = client.responses.create(model="m", input="hello", max_output_tokens=N)
    check(r.output_text == TOK * N and r.status == "incomplete", "responses.create")
    produced += N
    return produced


def anthropic_suite(client):
    produced = 0
    msgs = [{"role": "user", "content": "hello"}]
    with client.messages.stream(model="m", max_tokens=N, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    check(text == TOK * N, f"messages.stream text {text!r}")
    check(final.content[0].text == TOK * N, "final message")
    check(final.usage.output_tokens == N and final.stop_reason == "max_tokens", "usage, stop")
    produced += N

    events = [e.type for e in client.messages.create(model="m", max_tokens=N, messages=msgs, stream=True)]
    check(events[0] == "message_start" and events[-1] == "message_stop", f"raw events {events}")
    # (the SDK drops `ping` events itself)
    for k in ["content_block_start", "content_block_delta", "content_block_stop", "message_delta"]:
        check(k in events, f"raw event {k}")
    produced += N

    r = client.messages.create(model="m", max_tokens=N, messages=msgs)
    check(r.content[0].text == TOK * N and r.usage.output_tokens == N, "messages.create")
    produced += N
    return produced


def errors_suite(base, hold_base):
    dead = openai.OpenAI(base_url=base, api_key="k", max_retries=0,
                         default_headers={"x-to": "dead"})
    try:
        dead.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        check(False, "a dead upstream raises")
    except openai.APIStatusError as e:
        check(e.status_code == 502, f"502, not {e.status_code}")
        check(isinstance(e, openai.InternalServerError), f"typed: {type(e)}")
        check("refused the connection" in e.message, f"tokentap's message: {e.message}")
        check(e.body["code"] == "upstream_connect_failed", f"code {e.body}")

    capped = openai.OpenAI(base_url=hold_base, api_key="k", max_retries=0,
                           default_headers={"x-to": "capped"})
    # One long stream holds the only slot; the next request finds the queue full.
    holding = capped.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=400, stream=True)
    first = next(iter(holding))
    check(first is not None, "the slot is held")
    try:
        capped.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        check(False, "a full queue raises")
    except openai.RateLimitError as e:
        check(e.status_code == 429, "429")
        check("concurrency limit" in e.message, f"tokentap's message: {e.message}")
        check(e.body["code"] == "queue_full", f"code {e.body}")
    holding.close()


def main():
    with tempfile.TemporaryDirectory() as tmp:
        oa, resp, anth = sim("openai"), sim("responses"), sim("anthropic")
        slow = sim("openai", tpot_ms=20.0)
        dead = free_port()
        routes = (
            '[[route]]\npath_prefix = "/"\nheaders = { "x-to" = "dead" }\nsplit = { dead = 1 }\n'
            '[[route]]\npath_prefix = "/"\nheaders = { "x-to" = "capped" }\nsplit = { capped = 1 }\n'
            '[[route]]\npath_prefix = "/v1/responses"\nsplit = { responses = 1 }\n'
            '[[route]]\npath_prefix = "/v1/messages"\nsplit = { anthropic = 1 }\n'
            '[[route]]\npath_prefix = "/"\nsplit = { openai = 1 }\n'
        )

        def upstreams(inject):
            return (
                f'[[upstream]]\nname = "openai"\nurl = "http://127.0.0.1:{oa}"\ninject_usage = {inject}\n'
                f'[[upstream]]\nname = "responses"\nurl = "http://127.0.0.1:{resp}"\n'
                f'[[upstream]]\nname = "anthropic"\nurl = "http://127.0.0.1:{anth}"\n'
                f'[[upstream]]\nname = "dead"\nurl = "http://127.0.0.1:{dead}"\n'
                f'[[upstream]]\nname = "capped"\nurl = "http://127.0.0.1:{slow}"\n'
                'max_concurrency = 1\nmax_queue = 0\n'
            )

        for inject in ["false", "true"]:
            port, admin = proxy(upstreams(inject) + routes, tmp, f"inject-{inject}")
            base = f"http://127.0.0.1:{port}/v1"
            oc = openai.OpenAI(base_url=base, api_key="sk-test")
            ac = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="sk-test")
            want = {
                "openai": chat_suite(oc, True),
                "responses": responses_suite(oc),
                "anthropic": anthropic_suite(ac),
            }
            errors_suite(base, base)
            wait_idle(admin)
            s = stats(admin)
            for name, tokens in want.items():
                u = s[name]
                check(u["output_tokens_total"] == tokens,
                      f"inject_usage={inject}: /stats {name} output_tokens_total {u['output_tokens_total']} != {tokens}")
                check(u["errors_total"] == 0, f"{name} errors {u['errors_total']}")
            exact = s["openai"]["counts_exact"]
            check(exact is (inject == "true"), f"inject_usage={inject}: openai counts_exact {exact}")
            check(s["responses"]["counts_exact"] and s["anthropic"]["counts_exact"], "exact counts")
            check(s["dead"]["errors_total"] == 1, "the dead upstream's error counted")
            check(s["capped"]["rejected_total"] == 1, "the 429 counted")

        # The Responses helper against the simulator itself, no proxy between.
        direct = openai.OpenAI(base_url=f"http://127.0.0.1:{resp}/v1", api_key="sk-test")
        responses_suite(direct)
    print(f"sdk conformance: {checks} checks passed "
          f"(openai {openai.__version__}, anthropic {anthropic.__version__})")


if __name__ == "__main__":
    try:
        main()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
