"""`dynatree bench-serve`: a bounded load check of a running server (N requests, C clients at once).

Each client sends streamed chat completions (Spec-Bench questions by default) one after another;
a 429 is retried after its Retry-After and counted. Reported: latency and time to first token
(p50/p95), completion tokens per second over the whole run, requests per second, and the server's
own tokens per target pass. The report is printed; with --out it also goes to OUT/report.md, and the
results to OUT/results.json.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import statistics
import threading
import time
from pathlib import Path

from ..errors import DynaTreeError


def add_bench_serve_command(sub) -> None:
    p = sub.add_parser("bench-serve", help="load-check a running `dynatree serve` (latency, TTFT, throughput)",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server [http://127.0.0.1:8000]")
    p.add_argument("--requests", type=int, default=32, help="requests in all [32]")
    p.add_argument("--concurrency", type=int, default=4, help="clients sending at once [4]")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request [128]")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy [0]")
    p.add_argument("--dataset", default="specbench", help="prompts: a data set name or file, as in bench [specbench]")
    p.add_argument("--n", type=int, default=4, help="prompts taken from the data set (Spec-Bench: per task), sent in "
                                                    "turn until --requests are sent [4]")
    p.add_argument("--dynatree", metavar="JSON", help='the requests\' "dynatree" field, e.g. \'{"method": "ar"}\'')
    p.add_argument("--out", help="directory for results.json and report.md [none: the report is printed only]")
    p.set_defaults(run=cmd_bench_serve)


@dataclasses.dataclass
class Outcome:
    prompt_id: str
    status: int
    latency_s: float | None = None  # send -> [DONE] (after any 429 retries: from the accepted send)
    ttft_s: float | None = None  # send -> first text
    completion_tokens: int = 0
    tokens_per_pass: float | None = None
    refused: int = 0  # 429s before it was accepted
    error: str | None = None


def one_request(client, url: str, body: dict, prompt_id: str) -> Outcome:
    import httpx

    refused = 0
    while True:
        start = time.perf_counter()
        ttft = None
        try:
            with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                if response.status_code == 429:
                    refused += 1
                    time.sleep(float(response.headers.get("retry-after", "1")))
                    continue
                if response.status_code != 200:
                    response.read()
                    return Outcome(prompt_id, response.status_code, refused=refused, error=response.text[:200])
                final = None
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Outcome(prompt_id, 500, refused=refused, error=chunk["error"]["message"])
                    choice = chunk["choices"][0]
                    if ttft is None and choice["delta"].get("content"):
                        ttft = time.perf_counter() - start
                    if choice.get("finish_reason"):
                        final = chunk["dynatree"]
        except httpx.HTTPError as exc:
            return Outcome(prompt_id, 0, refused=refused, error=f"{type(exc).__name__}: {exc}")
        latency = time.perf_counter() - start
        if final is None:
            return Outcome(prompt_id, 0, refused=refused, error="the stream ended without a finish chunk")
        return Outcome(prompt_id, 200, latency, ttft, len(final["completion_token_ids"]), final["tokens_per_pass"],
                       refused)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarise(outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.status == 200]
    lat = [o.latency_s for o in ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tokens = sum(o.completion_tokens for o in ok)
    passes = [o.tokens_per_pass for o in ok if o.tokens_per_pass is not None]
    return {
        "requests": len(outcomes), "ok": len(ok), "failed": len(outcomes) - len(ok),
        "refused_429": sum(o.refused for o in outcomes), "wall_s": wall_s,
        "latency_p50_s": quantile(lat, 0.5), "latency_p95_s": quantile(lat, 0.95),
        "ttft_p50_s": quantile(ttft, 0.5), "ttft_p95_s": quantile(ttft, 0.95),
        "completion_tokens": tokens, "throughput_tok_s": tokens / wall_s if wall_s else None,
        "requests_per_s": len(ok) / wall_s if wall_s else None,
        "tokens_per_pass_median": statistics.median(passes) if passes else None,
    }


def report(summary: dict, settings: dict) -> str:
    def f(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f}"

    s = summary
    return "\n".join([
        f"# bench-serve: {settings['requests']} requests, {settings['concurrency']} clients at once",
        "",
        f"server {settings['url']} (model {settings['model']}), max_tokens {settings['max_tokens']}, "
        f"temperature {settings['temperature']}, prompts {settings['dataset']} (--n {settings['n']}), dynatree field "
        f"{settings['dynatree'] or '(server defaults)'}",
        "",
        "| ok | failed | 429s | latency p50 / p95 (s) | TTFT p50 / p95 (s) | tokens/s | requests/s | tokens/pass |",
        "|---|---|---|---|---|---|---|---|",
        f"| {s['ok']} | {s['failed']} | {s['refused_429']} | {f(s['latency_p50_s'])} / {f(s['latency_p95_s'])} | "
        f"{f(s['ttft_p50_s'], 3)} / {f(s['ttft_p95_s'], 3)} | {f(s['throughput_tok_s'], 1)} | "
        f"{f(s['requests_per_s'])} | {f(s['tokens_per_pass_median'])} |",
        "",
        "Latency and TTFT include the time a request waits in the server's queue (one decode at a time).",
        "",
    ])


def cmd_bench_serve(args) -> int:
    import httpx
    from tqdm import tqdm

    from ..prompts import load_texts

    for flag, value in (("--requests", args.requests), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise DynaTreeError(f"{flag} must be at least 1, got {value}")
    extra = None
    if args.dynatree is not None:
        try:
            extra = json.loads(args.dynatree)
        except json.JSONDecodeError as exc:
            raise DynaTreeError(f"--dynatree is not JSON: {exc.msg}") from None
        if not isinstance(extra, dict):
            raise DynaTreeError("--dynatree must be a JSON object, e.g. '{\"method\": \"ar\"}'")
    url = args.url.rstrip("/")
    try:
        health = httpx.get(url + "/health", timeout=10)
    except httpx.HTTPError as exc:
        raise DynaTreeError(f"no server at {url}: {type(exc).__name__} (start one with `dynatree serve`)") from None
    if health.status_code != 200:
        raise DynaTreeError(f"the server at {url} is not ready: {health.text[:200]}")
    model = health.json()["model"]
    prompts = load_texts(args.dataset, args.n)
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    bodies = [{"model": model, "messages": [{"role": "user", "content": p.text}], "max_tokens": args.max_tokens,
               "temperature": args.temperature, "stream": True, **({"dynatree": extra} if extra else {})}
              for p in prompts]

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    bar = tqdm(total=args.requests, desc="requests", unit="req")
    with httpx.Client(timeout=None) as client, concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        start = time.perf_counter()

        def run(i):
            outcome = one_request(client, url, bodies[i], prompts[i].id)
            with lock:
                outcomes.append(outcome)
                bar.update()
            return outcome

        list(pool.map(run, range(args.requests)))
        wall = time.perf_counter() - start
    bar.close()
    settings = {"url": url, "model": model, "requests": args.requests, "concurrency": args.concurrency,
                "max_tokens": args.max_tokens, "temperature": args.temperature, "dataset": args.dataset,
                "n": args.n, "dynatree": extra}
    summary = summarise(outcomes, wall)
    text = report(summary, settings)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary,
                                                      "requests": [dataclasses.asdict(o) for o in outcomes]},
                                                     indent=1))
        (out / "report.md").write_text(text)
    failed = [o for o in outcomes if o.status != 200]
    if failed:
        raise DynaTreeError(f"{len(failed)} of {len(outcomes)} requests failed, e.g. {failed[0].error}")
    return 0
