"""One JSON line per A/B run of run_ab.sh: the bench line's figures, the trace, and the
per-request join of the client's stamps with the server's (stamps_bench.py,
stamps_serve.py): ``python summarize.py TAG...`` with ``$OUT_DIR`` (default /tmp/i50f)
holding the runs and ``runab.log`` (the ``uptime`` line before each round, then one line
per run starting with its tag). Tags: B (before: main's inline limit), N (after), U
(after, with uvloop and httptools on the path), then _round."""
import json
import os
import sys

D = os.environ.get("OUT_DIR", "/tmp/i50f")
def pct(v, q):
    v = sorted(v); return round(v[min(len(v) - 1, int(q / 100 * len(v)))], 3) if v else None
def run(tag, variant, load):
    d = json.loads(open(f'{D}/{tag}.jsonl').readlines()[-1])
    srv = [json.loads(l) for l in open(f'{D}/{tag}')]
    a, b = srv[-2], srv[-1]
    cli = {r['port']: r for r in json.load(open(f'{D}/{tag}.client'))}
    rows = []
    for r in b['rows']:
        c = cli.get(r['port'])
        if not c or 'first_piece' not in c or r.get('written') is None:
            continue
        x = {k: c[k] * 1e6 for k in ('open', 'connected', 'sent', 'first_piece')}
        x.update({k: r[k] for k in ('conn', 'asgi', 'arrived', 'tokenized', 'routed', 'written') if r.get(k) is not None})
        rows.append(x)
    def span(a_, b_):
        return pct([(x[b_] - x[a_]) / 1000 for x in rows if a_ in x and b_ in x], 50)
    t = d['first_token_trace']
    out = {"run": tag, "variant": variant, "load1_before": load.get(tag),
           **{k: d[k] for k in ('commit', 'max_concurrency', 'num_prompts', 'random_input_len',
                                'random_output_len', 'completed', 'errors', 'duration_s',
                                'median_ttft_ms', 'p99_ttft_ms', 'mean_ttft_ms', 'median_tpot_ms',
                                'p99_itl_ms', 'output_throughput', 'cpu_count')},
           "stub": d.get("stub"), "client_cpu_s": d.get("client_cpu_s"),
           "client_cpu_share": d.get("client_cpu_share"),
           "trace_total_ms": t['total_ms'], "trace_frontend_ms": t['frontend_ms'],
           "trace_stages_ms": t['stages_ms'], "trace_rank_steps": t['rank_steps'],
           "joined_requests": len(rows),
           "p50_ms": {"client_send_to_first_chunk": span('open', 'first_piece'),
                      "client_send_to_handler_start (untraced)": span('open', 'arrived'),
                      "client_send_to_connected (client loop)": span('open', 'connected'),
                      "client_sent_to_server_asgi (server accept+parse queue)": span('sent', 'asgi'),
                      "server_asgi_to_handler_start": span('asgi', 'arrived'),
                      "handler_start_to_tokenized": span('arrived', 'tokenized'),
                      "handler_start_to_sse_write (trace total)": span('arrived', 'written'),
                      "sse_write_to_client_first_chunk": span('written', 'first_piece')},
           "server_process_cpu_s": round(b['cpu_s'] - a['cpu_s'], 3),
           "server_cpu_ms_per_request": round((b['cpu_s'] - a['cpu_s']) / max(len(b['rows']), 1) * 1e3, 3)}
    return out
if __name__ == "__main__":
    load = {}
    # the uptime line printed before each round applies to its 4 runs
    cur = None
    for line in open(f'{D}/runab.log'):
        if 'load average' in line:
            cur = float(line.split('load average:')[1].split(',')[0])
        elif line[:1].isalpha():
            load[line.split()[0]] = cur
    for tag in sys.argv[1:]:
        variant = {'B': 'before', 'N': 'after', 'U': 'after+uvloop+httptools'}[tag[0]]
        r = int(tag.split('_')[1])
        limit = 1024 if tag[0] == 'B' else (8192 if r <= 3 else 4096)
        out = run(tag, variant, load)
        out["inline_prompt_chars"] = limit
        print(json.dumps(out))
