#!/usr/bin/env python3
"""The coordinator's status page (`--http-listen`) for real, and `wsyncctl history --plot`.

1. A running cluster (coordinator with --http-listen, a reference engine pair behind a target wsyncd, a source wsyncd,
   one trainer rank driving 2 real updates whose bytes the trainer verifies on both engines): headless Chromium
   (Debian's `chromium`, installed with apt-get when missing) loads the page, dumps the DOM it built and takes a
   screenshot. The DOM must hold a bar per phase of each update (per engine and per source too) and every
   membership/engine row; the screenshot must not be blank and must show the push bars' colour.
2. `wsyncctl history --plot`: SVG (well-formed XML, the same bars), PNG through rsvg-convert (Debian's librsvg2-bin,
   installed when missing; a non-blank image), and a version not in the history refused naming the versions held.
3. TLS: a coordinator with mTLS serves the page over HTTPS to a client with a certificate of the cluster CA, and
   refuses a client without a certificate, one with another CA's certificate, and plain HTTP.
"""
import argparse
import os
import re
import shutil
import ssl
import struct
import subprocess
import sys
import urllib.request
import xml.etree.ElementTree as ET
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engines"))
import harness  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PUSH_RGB = (0x4E, 0x79, 0xA7)  # the push phase's colour in daemon/coordinator/timeline_svg.cc


def ensure(binary: str, package: str) -> str:
    """The path of `binary`, installing Debian's `package` with apt-get when it is missing (a failure, not a skip)."""
    path = shutil.which(binary)
    if path:
        return path
    print(f"status_page_ui_test: {binary} is missing; installing Debian's {package}", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    subprocess.run(sudo + ["apt-get", "update", "-qq"], env=env, check=True)
    subprocess.run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    path = shutil.which(binary)
    if not path:
        raise RuntimeError(f"{package} was installed but {binary} is not on PATH")
    return path


def png_pixels(path: str):
    """(width, height, rows of RGB tuples) of an 8-bit RGB/RGBA/grey PNG, non-interlaced (what Chromium and
    rsvg-convert write): a small reader, so the test needs no imaging library."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, ihdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, color, _, _, interlace = ihdr
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    if depth != 8 or interlace != 0:
        raise ValueError(f"{path}: bit depth {depth}, interlace {interlace} not handled")
    raw = zlib.decompress(idat)
    stride = w * channels
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - channels] if x >= channels else 0
            b, c = prev[x], prev[x - channels] if x >= channels else 0
            if f == 1:
                line[x] = (line[x] + a) & 0xFF
            elif f == 2:
                line[x] = (line[x] + b) & 0xFF
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(line)
        prev = line
    px = []
    for line in rows:
        if channels >= 3:
            px.append([tuple(line[x * channels:x * channels + 3]) for x in range(w)])
        else:
            px.append([(line[x * channels],) * 3 for x in range(w)])
    return w, h, px


def pixel_counts(path: str):
    """(non-white pixels, pixels of the push colour) of a PNG."""
    _, _, px = png_pixels(path)
    nonwhite = push = 0
    for row in px:
        for p in row:
            if p != (255, 255, 255):
                nonwhite += 1
            if all(abs(p[k] - PUSH_RGB[k]) <= 6 for k in range(3)):
                push += 1
    return nonwhite, push


def phase_rects(markup: str):
    """[(version, row, phase)] of every timeline bar in HTML or SVG text."""
    out = []
    for attrs in re.findall(r'<rect class="phase"([^>]*)>', markup):
        a = dict(re.findall(r'([a-z-]+)="([^"]*)"', attrs))
        out.append((a.get("data-version"), a.get("data-row"), a.get("data-phase")))
    return out


def check_timeline(check, bars, versions, what):
    for v in versions:
        mine = [b for b in bars if b[0] == str(v)]
        update = [b[2] for b in mine if b[1] == "update"]
        # The first update configures the source (a new plan); the second, with the plan unchanged, does not.
        for phase in ("pause", "configure" if v == 1 else "push", "push", "post_process", "set_version", "continue"):
            check(phase in update, f"{what}: update {v} has its {phase} phase")
        check(("%d" % v, "source:train0", "push") in mine, f"{what}: update {v} has source train0's push")
        for e in ("engine0", "engine1"):
            for phase in ("pause", "post_process", "continue"):
                check(("%d" % v, f"engine:{e}", phase) in mine, f"{what}: update {v} has {e}'s {phase} call")


def chromium(binary: str, wd: str, url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--no-first-run", "--hide-scrollbars", f"--user-data-dir={wd}/chromium-profile",
                           "--window-size=1280,1800", *args, url],
                          capture_output=True, text=True, timeout=90)


def cluster_checks(check, b: str, model: str, wd: str, chrome: str) -> None:
    procs = harness.Procs(wd)
    try:
        def port_of(name: str) -> int:
            path = os.path.join(wd, f"{name}.port")
            return harness.wait_for(f"{name} port", lambda: harness.read_port_file(path), 60, procs, [name], 0.05)

        page_port = harness.free_port()
        procs.start("coordinator", [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0", "--port-file",
                                    os.path.join(wd, "coordinator.port"), "--http-listen", f"127.0.0.1:{page_port}"])
        coord = f"127.0.0.1:{port_of('coordinator')}"
        engines = []
        for e in ("engine0", "engine1"):
            procs.start(e, [f"{b}/wsync-engine-ref", "--id", e, "--model", model, "--tp", "1", "--listen",
                            "127.0.0.1:0", "--port-file", os.path.join(wd, f"{e}.port")])
            engines.append(f"127.0.0.1:{port_of(e)}")
        for i, eng in enumerate(engines):
            procs.start(f"target{i}", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "target", "--node-id",
                                       f"infer{i}", "--coordinator", coord, "--engine", f"reference+grpc://{eng}",
                                       "--engine-socket", os.path.join(wd, f"target{i}.sock"), "--port-file",
                                       os.path.join(wd, f"target{i}.port")])
            port_of(f"target{i}")
        procs.start("source", [f"{b}/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id", "train0",
                               "--coordinator", coord, "--trainer-socket", os.path.join(wd, "source.sock"),
                               "--trainer-ranks", "1", "--ring-mib", "16", "--port-file",
                               os.path.join(wd, "source.port")])
        port_of("source")
        # The trainer verifies every engine's bytes against its own weights after each update (--verify-engine).
        trainer = subprocess.run(
            [f"{b}/wsync-trainer-demo", "--daemon", os.path.join(wd, "source.sock"), "--model", model,
             "--local-rank", "0", "--global-rank", "0", "--updates", "2", "--drive", "--coordinator", coord]
            + [x for eng in engines for x in ("--verify-engine", eng)],
            capture_output=True, text=True, timeout=120)
        check(trainer.returncode == 0, "2 updates pushed, committed and verified on both engines"
              + ("" if trainer.returncode == 0 else f":\n{trainer.stdout[-2000:]}\n{trainer.stderr[-2000:]}"))

        url = f"http://127.0.0.1:{page_port}/"
        html = urllib.request.urlopen(url, timeout=10).read().decode()
        check("<script" not in html, "the page carries no script")
        dom = chromium(chrome, wd, url, "--dump-dom")
        check(dom.returncode == 0 and "<svg" in dom.stdout,
              "Chromium loads the page and builds its DOM" + ("" if dom.returncode == 0 else f": {dom.stderr[-1500:]}"))
        bars = phase_rects(dom.stdout)
        check(len(bars) >= 2 * (6 + 1 + 2 * 4), f"the timeline in Chromium's DOM has the bars of both updates "
              f"({len(bars)})")
        check_timeline(check, bars, (1, 2), "Chromium's DOM")
        for node in ("train0", "infer0", "infer1"):
            check(f"<td>{node}</td>" in dom.stdout, f"membership lists {node}")
        for e in ("engine0", "engine1"):
            m = re.search(rf'<tr data-engine="{e}">(.*?)</tr>', dom.stdout)
            check(m is not None and "<td>2</td>" in m.group(1) and ">ready<" in m.group(1),
                  f"{e}: version 2, ready")
        shot = os.path.join(wd, "page.png")
        s = chromium(chrome, wd, url, f"--screenshot={shot}")
        check(s.returncode == 0 and os.path.exists(shot), "Chromium takes a screenshot")
        if os.path.exists(shot):
            nonwhite, push = pixel_counts(shot)
            print(f"screenshot: {nonwhite} non-white pixels, {push} of the push colour", flush=True)
            check(nonwhite > 20000, "the screenshot is not blank")
            check(push > 500, "the screenshot shows the push bars")
        svg = urllib.request.urlopen(f"http://127.0.0.1:{page_port}/timeline.svg?n=1", timeout=10)
        body = svg.read().decode()
        check(svg.headers.get("Content-Type", "").startswith("image/svg+xml") and
              {r[0] for r in phase_rects(body)} == {"2"}, "/timeline.svg?n=1: the last update only, as SVG")

        # wsyncctl history --plot: SVG, PNG, and a version the history does not hold.
        ctl = [f"{b}/wsyncctl", "--endpoints", coord, "history"]
        out_svg = os.path.join(wd, "updates.svg")
        r = subprocess.run(ctl + ["--plot", out_svg], capture_output=True, text=True, timeout=30)
        check(r.returncode == 0 and os.path.exists(out_svg), "history --plot FILE.svg" + ("" if r.returncode == 0
                                                                                          else f": {r.stderr}"))
        if os.path.exists(out_svg):
            text = open(out_svg).read()
            try:
                ET.fromstring(text)
                check(True, "the plot is well-formed XML")
            except ET.ParseError as e:
                check(False, f"the plot is well-formed XML ({e})")
            check_timeline(check, phase_rects(text), (1, 2), "history --plot")
        out_png = os.path.join(wd, "v2.png")
        r = subprocess.run(ctl + ["--plot", out_png, "--version", "2"], capture_output=True, text=True, timeout=30)
        check(r.returncode == 0 and os.path.exists(out_png), "history --plot FILE.png --version 2" +
              ("" if r.returncode == 0 else f": {r.stderr}"))
        if os.path.exists(out_png):
            nonwhite, push = pixel_counts(out_png)
            check(nonwhite > 5000 and push > 200, f"the PNG is a drawing ({nonwhite} non-white, {push} push pixels)")
        r = subprocess.run(ctl + ["--plot", os.path.join(wd, "x.svg"), "--version", "7"], capture_output=True,
                           text=True, timeout=30)
        check(r.returncode == 1 and "version 7 is not in the coordinator's history" in r.stderr
              and "holds versions 1-2" in r.stderr, f"a version not in the history is refused, naming those held "
              f"(exit {r.returncode}: {r.stderr.strip()})")
        check(not os.path.exists(os.path.join(wd, "x.svg")), "and no file is written")
        r = subprocess.run(ctl + ["--plot", os.path.join(wd, "x.pdf")], capture_output=True, text=True, timeout=30)
        check(r.returncode == 2 and ".svg" in r.stderr, "--plot x.pdf: a usage error naming the formats")
    finally:
        procs.close()


def tls_checks(check, b: str, wd: str) -> None:
    certs, foreign = os.path.join(wd, "certs"), os.path.join(wd, "foreign")
    gen = os.path.join(ROOT, "tools", "cli", "wsync-certs.sh")
    subprocess.run([gen, certs, "coordinator:ui", "admin:ui"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([gen, foreign, "admin:ui"], check=True, stdout=subprocess.DEVNULL)
    procs = harness.Procs(wd)
    try:
        page_port = harness.free_port()
        procs.start("tls-coordinator", [f"{b}/wsync-coordinator", "--listen", "127.0.0.1:0", "--port-file",
                                        os.path.join(wd, "tls.port"), "--http-listen", f"127.0.0.1:{page_port}",
                                        "--tls-ca", f"{certs}/ca.pem", "--tls-cert", f"{certs}/coordinator-ui.pem",
                                        "--tls-key", f"{certs}/coordinator-ui-key.pem"])
        harness.wait_for("TLS coordinator port", lambda: harness.read_port_file(os.path.join(wd, "tls.port")), 60,
                         procs, ["tls-coordinator"], 0.05)
        url = f"https://127.0.0.1:{page_port}/"

        def get(cert_dir):
            ctx = ssl.create_default_context(cafile=f"{certs}/ca.pem")
            if cert_dir:
                ctx.load_cert_chain(f"{cert_dir}/admin-ui.pem", f"{cert_dir}/admin-ui-key.pem")
            with urllib.request.urlopen(url, timeout=10, context=ctx) as r:
                return r.status, r.read().decode()

        status, body = get(certs)
        check(status == 200 and "wsync coordinator" in body and "no updates recorded yet" in body,
              "HTTPS with an admin certificate of the cluster CA: the page")
        for what, cert_dir in (("no client certificate", None), ("another CA's certificate", foreign)):
            try:
                status, _ = get(cert_dir)
                check(False, f"{what}: refused (got HTTP {status})")
            except (OSError, ssl.SSLError) as e:
                check(True, f"{what}: refused ({type(e).__name__}: {str(e)[:120]})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{page_port}/", timeout=10) as r:
                check(False, f"plain HTTP to the TLS page: refused (got HTTP {r.status})")
        except OSError as e:
            check(True, f"plain HTTP to the TLS page: refused ({type(e).__name__})")
        check(procs.alive("tls-coordinator"), "the coordinator serves on after the refusals")
        status, _ = get(certs)
        check(status == 200, "and still serves a valid client")
    finally:
        procs.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (screenshot, plots, logs)")
    args = ap.parse_args()
    chrome = ensure("chromium", "chromium")
    ensure("rsvg-convert", "librsvg2-bin")
    check = harness.Checks()
    with harness.workdir("wsync-status-page-", keep=args.keep) as wd:
        cluster_checks(check, os.path.abspath(args.bin), os.path.abspath(args.model), wd, chrome)
        tls_checks(check, os.path.abspath(args.bin), wd)
    return check.verdict()


if __name__ == "__main__":
    sys.exit(main())
