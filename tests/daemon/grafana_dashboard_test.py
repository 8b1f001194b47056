#!/usr/bin/env python3
"""deploy/grafana/wsync-dashboard.json against the metrics the daemons really export: a coordinator and a source
wsyncd are started with --metrics-listen, their /metrics scraped, and every metric name in every panel's query must be
a family one of them declares (histograms through their _bucket/_sum/_count series), and every counter and
histogram the board queries has its series already at 0 before the first update. Also: the JSON loads, panel ids
are unique, every panel queries the dashboard's Prometheus datasource variable."""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def scrape(addr, deadline):
    """({family: type} from the # TYPE lines of http://addr/metrics, {names of the samples}), retried until the
    listener answers."""
    while True:
        try:
            text = urllib.request.urlopen("http://%s/metrics" % addr, timeout=2).read().decode()
            return (dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)),
                    set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M)))
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    args = ap.parse_args()
    dash = json.load(open(os.path.join(ROOT, "deploy", "grafana", "wsync-dashboard.json")))
    panels = dash.get("panels", [])
    ids = [p.get("id") for p in panels]
    check(len(panels) > 0 and len(ids) == len(set(ids)), "%d panels with unique ids" % len(panels))
    check(all(t.get("datasource", {}).get("uid") == "${datasource}" for p in panels for t in p.get("targets", [])),
          "every query uses the dashboard's datasource variable")

    with tempfile.TemporaryDirectory() as wd:
        cm, sm = "127.0.0.1:%d" % free_port(), "127.0.0.1:%d" % free_port()
        pf = os.path.join(wd, "coord.port")
        procs = [subprocess.Popen([os.path.join(args.bin, "wsync-coordinator"), "--listen", "127.0.0.1:0",
                                   "--port-file", pf, "--metrics-listen", cm],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            deadline = time.time() + 30
            while not os.path.exists(pf) and time.time() < deadline:
                time.sleep(0.05)
            coord = "127.0.0.1:" + open(pf).read().strip()
            procs.append(subprocess.Popen([os.path.join(args.bin, "wsyncd"), "--role", "source", "--coordinator",
                                           coord, "--listen", "127.0.0.1:0", "--ring-mib", "4", "--transport", "tcp",
                                           "--trainer-socket", os.path.join(wd, "t.sock"), "--metrics-listen", sm],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            families, sampled = {}, set()
            for addr in (cm, sm):
                f, s = scrape(addr, time.time() + 30)
                families.update(f)
                sampled |= s
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)
    print("exported: %d metric families" % len(families))
    used = 0
    for p in panels:
        for t in p.get("targets", []):
            for name in re.findall(r"\bwsync_[a-z0-9_]+", t.get("expr", "")):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                ok = name in families or (base != name and families.get(base) in ("histogram", "summary"))
                used += 1
                check(ok, "panel %r: %s is exported%s" % (p.get("title"), name,
                                                         "" if ok else " (no such metric family)"))
                # Before any update: a counter or histogram the board queries has its series already (at 0), so
                # rate() and increase() see the first update's count.
                if families.get(base) in ("counter", "histogram"):
                    sample = base + "_count" if families[base] == "histogram" else base
                    check(sample in sampled, "panel %r: %s is exported at 0 before the first update" %
                          (p.get("title"), name))
    check(used > 0, "the dashboard queries %d metric references" % used)
    if failures:
        print("FAILED: %d checks" % len(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
