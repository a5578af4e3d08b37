"""One S8 run's timeline: per second of wall time, the simulator's running sequences (largest),
kvgate's ledger (requests in flight, sampled rows of their worst step, the forward tokens it
charges), and how the budget answered (refusals by term, the last refusal's charge and limit)."""
import bisect, collections, json, sys
d = sys.argv[1]
S = json.load(open(f"{d}/samples.json"))
L = [json.loads(l) for l in open(f"{d}/shortfall.jsonl")]
t0 = S[0][0]
run = collections.defaultdict(int)
for t, r, w in S:
    run[int(t - t0)] = max(run[int(t - t0)], r)
rows = collections.defaultdict(list)
for e in L:
    if "update" in e:
        continue
    rows[int(e["t"] - t0)].append(e)
print("s  sim_running  ledger_inflight  ledger_rows  ledger_fwd_tokens_charged  refused(charge/anycache/kv)  admitted  last_refusal_charge/limit_MiB")
for s in sorted(set(run) | set(rows)):
    es = rows.get(s, [])
    nz = [e for e in es if e["inflight"] > 0]
    last = nz[-1] if nz else None
    c = collections.Counter(e["why"] for e in es)
    ref = [e for e in es if e["why"] == "charge"]
    lr = f"{ref[-1]['charge']//2**20}/{ref[-1]['lim']//2**20}" if ref else "-"
    cur_tok = max((e["fwd_tok"] - (e["rows"] - e["cur_rows"]) for e in nz), default=0)
    print(f"{s:2d} {run.get(s,0):4d} {last['inflight'] if last else 0:4d} {last['cur_rows'] if last else 0:4d} {cur_tok:5d}  {c.get('charge',0)}/{c.get('anycache',0)}/{c.get('kv',0)}  {c.get(None,0)}  {lr}")
