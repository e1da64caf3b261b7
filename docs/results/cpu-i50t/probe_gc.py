import subprocess, sys, os, signal, time
from elasticep_testkit.paths import DEMO_MODEL
cmd = [sys.executable, "docs/results/cpu-i50t/gc_serve.py", "--stub-engine-steps-per-s", "30.0", "--model", str(DEMO_MODEL), "--device", "cpu", "--port", "0"]
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
for line in p.stdout:
    if line.startswith("ready:"):
        url = line.split()[1]; break
src = open("docs/results/cpu-i50t/probe_ttft.py").read().split("serve = ServeProcess")[0]
sys.argv = ["x", "64", "128"]
exec(src)
import asyncio
T0=time.time(); asyncio.run(main(url)); T1=time.time()
p.send_signal(signal.SIGINT); p.wait(60)
import json
ps=[x for x in json.load(open("/tmp/gc_pauses.json")) if T0 <= x[2] <= T1]
by={}
for g,ms,_ in ps: by.setdefault(g,[]).append(ms)
print("during the run:", {g:[len(v), round(sum(v),1), round(max(v),2)] for g,v in by.items()}, "run s", round(T1-T0,2)); raise SystemExit
st = pstats.Stats("/tmp/fe_threads.prof"); st.sort_stats("tottime").print_stats(30)
