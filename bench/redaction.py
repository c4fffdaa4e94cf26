#!/usr/bin/env python3
"""Redaction benchmark: recall per format family, false-positive rate on benign look-alikes,
and redaction time per MB.

Positives are generated from the public formats of mainstream secret scanners (prefix,
alphabet, length, and the checksum where the format has one), each placed in the contexts
transcripts hold them in (shell, .env, JSON, fenced YAML, logs, prose, curl, URLs), and a
sample counts as caught only when every secret value in it is gone. Negatives are benign text
that looks like secrets (hashes, UUIDs, base64 images, public keys, identifiers, placeholders,
code, prose in several languages); a negative counts as a false positive when redaction
changes any byte of it.

    python3 bench/redaction.py                 # the table
    python3 bench/redaction.py --n 50 --json   # more samples per format, machine-readable
"""
import argparse
import base64
import json
import os
import random
import statistics
import string
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
memshelf = None   # imported in main() from --code (default: this checkout)

UP, LO, DG = string.ascii_uppercase, string.ascii_lowercase, string.digits
AN, HEX = UP + LO + DG, "0123456789abcdef"
B64, URL = AN + "+/", AN + "_-"
BASE62 = DG + UP + LO


def crc_token(rng, prefix, n=30):
    """GitHub/npm style: n base62 characters and the base62 CRC32 of them, six wide."""
    body = "".join(rng.choice(AN) for _ in range(n))
    crc, digits = zlib.crc32(body.encode()), ""
    while crc:
        crc, r = divmod(crc, 62)
        digits = BASE62[r] + digits
    return prefix + body + digits.rjust(6, "0")


def formats(rng):
    """family -> [generator of one secret value]."""
    def r(alphabet, n):
        return "".join(rng.choice(alphabet) for _ in range(n))

    def pypi():
        raw = b"\x02\x01\x08pypi.org\x02" + bytes(rng.randrange(256) for _ in range(60))
        return "pypi-" + base64.urlsafe_b64encode(raw).decode().rstrip("=")
    return {
        "cloud": [lambda: "AKIA" + r(UP + "234567", 16), lambda: "AIza" + r(URL, 35),
                  lambda: r(AN, 3) + "8Q~" + r(AN + "_~.-", 34), lambda: "dop_v1_" + r(HEX, 64),
                  lambda: "da2-" + r(LO + DG, 26), lambda: "ABSK" + r(B64, 128),
                  lambda: "LTAI" + r(AN, 20), lambda: "HRKU-AA" + r(URL, 58),
                  lambda: "GOCSPX-" + r(URL, 28), lambda: "dapi" + r(HEX, 32)],
        "vcs": [lambda: crc_token(rng, "ghp_"), lambda: crc_token(rng, "gho_"),
                lambda: "github_pat_" + r(AN, 22) + "_" + r(AN, 59), lambda: "glpat-" + r(URL, 20),
                lambda: "glrt-" + r(URL, 20), lambda: "ATBB" + r(AN, 32),
                lambda: "ATATT3" + r(URL, 186)],
        "registry": [lambda: crc_token(rng, "npm_"), pypi, lambda: "dckr_pat_" + r(URL, 27),
                     lambda: "AKCp" + r(AN, 69), lambda: "rubygems_" + r(HEX, 48)],
        "chat": [lambda: f"xoxb-{r(DG, 12)}-{r(DG, 13)}-{r(AN, 24)}",
                 lambda: f"{r(DG, 10)}:AA{r(URL, 33)}", lambda: "SK" + r(HEX + "ABCDEF", 32),
                 lambda: f"SG.{r(URL, 22)}.{r(URL, 43)}", lambda: "key-" + r(HEX, 32)],
        "payment": [lambda: "sk_live_" + r(AN, 99), lambda: "rk_prod_" + r(AN, 40),
                    lambda: "sq0atp-" + r(URL, 22), lambda: "shpat_" + r(HEX, 32)],
        "ai": [lambda: "sk-proj-" + r(URL, 74) + "T3BlbkFJ" + r(URL, 74),
               lambda: "sk-ant-api03-" + r(URL, 93) + "AA", lambda: "sk-ant-admin01-" + r(URL, 93) + "AA",
               lambda: "hf_" + r(LO + UP, 34), lambda: "gsk_" + r(AN, 52), lambda: "xai-" + r(AN, 80)],
        "devtools": [lambda: "hvs." + r(URL, 90), lambda: "hvb." + r(URL, 140),
                     lambda: "dp.pt." + r(AN, 43), lambda: "pul-" + r(HEX, 40),
                     lambda: f"sgp_{r(HEX, 16)}_{r(HEX, 40)}",
                     lambda: "A3-" + "-".join(r(UP + DG, n) for n in (6, 11, 5, 5, 5)),
                     lambda: "fm2_" + r(B64, 120), lambda: "pscale_tkn_" + r(AN, 43),
                     lambda: "EAAC" + r(AN, 120), lambda: f"PMAK-{r(HEX, 24)}-{r(HEX, 34)}",
                     lambda: f"pat{r(AN, 14)}.{r(HEX, 64)}", lambda: "API-" + r(UP + DG, 26),
                     lambda: "eyJrIjoi" + r(AN, 80), lambda: f"dt0c01.{r(AN, 24)}.{r(AN, 64)}"],
        "password": [lambda: r(AN + "!@$%", 14), lambda: r(LO, 6) + r(DG, 3) + rng.choice("!@$%:/"),
                     lambda: "P@" + r(AN, 8) + "$" + r(DG, 2)],
        "generic-key": [lambda: r(HEX, 32), lambda: r(LO + DG, 40), lambda: r(AN, 64),
                        lambda: r(B64, 86) + "=="],
    }


PREFIXED = ("cloud", "vcs", "registry", "chat", "payment", "ai", "devtools")
CONTEXTS = [
    "export SERVICE_TOKEN={v}\n", "SERVICE_TOKEN='{v}'\n", '{{"token": "{v}", "user": "ci"}}\n',
    "```yaml\nauth:\n  token: {v}\n```\n", "2026-05-02T10:11:12Z DEBUG using {v} for the call\n",
    "The deploy used {v} until it was rotated.\n", 'curl -H "Authorization: Bearer {v}" https://api.acme.io\n',
    "keys = ['{v}', 'other']\n", "GET /hook?token={v}&state=1 200\n", "(see `{v}`).\n",
    '{{\\"config\\": {{\\"key\\": \\"{v}\\"}}}}\n', "  - {v}\n",
]
PASSWORD_CONTEXTS = [
    "DB_PASSWORD={v}\n", '{{"password": "{v}"}}\n', "curl -u elastic:{v} https://es.acme.io:9200\n",
    "postgres://app:{v}@db.acme.io:5432/atlas\n", "mysql -u root -p{v} atlas\n",
    "--password={v}\n",
]
SERVICE_CONTEXTS = [
    "ALGOLIA_KEY={v}\n", "datadog_api: '{v}'\n", '"sumo_access_key": "{v}"\n',
    "AZURE_OPENAI_API_KEY={v}\n", "twilio_auth = \"{v}\"\n", "AZURE_STORAGE_KEY={v}\n",
    "curl -H 'apikey: {v}' https://x.acme.io\n", "--api-key {v}\n", "X-Api-Key: {v}\n",
    "<add key=\"StorageKey\" value=\"{v}\" />\n",
]


def positives(rng, n):
    """[(family, text, [values])]; every format appears n times, in rotating contexts."""
    out = []
    for family, gens in formats(rng).items():
        contexts = (CONTEXTS if family in PREFIXED else
                    PASSWORD_CONTEXTS if family == "password" else SERVICE_CONTEXTS)
        for gen in gens:
            for i in range(n):
                v = gen()
                out.append((family, contexts[i % len(contexts)].format(v=v), [v]))
    for i in range(n):   # taint: found by context once, repeated bare later
        v = "".join(rng.choice(AN) for _ in range(20))
        out.append(("taint", f"export API_TOKEN={v}\n... later the log printed {v} again\n", [v]))
        body = [("".join(rng.choice(B64) for _ in range(64))) for _ in range(4)]
        pem = "\\n".join(body)
        out.append(("private-key", '{"private_key": "-----BEGIN PRIVATE KEY-----\\n' + pem
                    + '\\n-----END PRIVATE KEY-----\\n"}\n', body))
    return out


PROSE = [
    "The team decided to keep the cache warm between deploys and to review the rollout plan.",
    "Das Team hat entschieden, den Cache zwischen den Deployments warm zu halten.",
    "L'équipe a décidé de garder le cache chaud entre les déploiements.",
    "El equipo decidió mantener la caché caliente entre despliegues y revisar el plan.",
    "Команда решила держать кэш прогретым между выкладками и пересмотреть план.",
    "团队决定在部署之间保持缓存预热，并重新审查发布计划。",
    "チームはデプロイの間キャッシュを温かく保つことに決めた。",
    "The key insight: tokens are rotated weekly and the secret lives in the vault.",
    "Password: reset flow decided; the token: rotated weekly.",
]
PLACEHOLDERS = [
    "curl -u 'test:test' https://api.acme.io", 'curl --user "xxx:yyy" https://api.acme.io',
    "curl -u <user:password> https://api.acme.io", "xoxb-abcdef-abcdef", '"xoxp-1234567890"',
    "password=secret123", 'iam_api_key="%s" % NAME', "- (id)hf_requiredCharacteristicTypesForSharing;",
    "API_KEY=<your key>", "export OPENAI_API_KEY=${OPENAI_API_KEY}", "DB_PASSWORD=changeme",
    "TOKEN={{ vault_token }}", "api_key = os.environ['API_KEY']", "token = request.headers.get('X')",
    "password = getpass()", "MAX_TOKENS=4096", "ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "AKIAIOSFODNN7EXAMPLE", "Authorization: Bearer <token>", "sk-...",
]


def negatives(rng, n):
    def r(alphabet, k):
        return "".join(rng.choice(alphabet) for _ in range(k))
    png = base64.b64encode(bytes(rng.randrange(256) for _ in range(120))).decode()
    makers = {
        "hash": lambda: rng.choice(["commit ", "sha256:", "git checkout ", "md5 "]) + r(HEX, rng.choice((32, 40, 64))),
        "uuid": lambda: "request " + "-".join(r(HEX, k) for k in (8, 4, 4, 4, 12)) + " failed",
        "image": lambda: f"![chart](data:image/png;base64,iVBORw0KGgo{png})",
        "public-key": lambda: rng.choice(["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI", "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ"])
        + r(B64, 43) + " ops@bastion",
        "identifier": lambda: rng.choice(["userProfileCacheMaxEntries", "hf_required_characteristic_types",
                                          "sk_learn_pipeline_config", "fetchAccessTokenForRefreshFlow",
                                          "com.acme.payments.tokenizer", "KEY_ROTATION_INTERVAL_SECONDS"])
        + rng.choice(["()", " = None", ": str", ".get()"]),
        "code": lambda: rng.choice(["client = Client(api_key=api_key)", "if token == expected:",
                                    "const token = process.env.GITHUB_TOKEN;", "secret = settings.SECRET_KEY",
                                    "cache_key = f'{user}:{page}'", "auth = HTTPBasicAuth(user, pw)"]),
        "integrity": lambda: f'integrity="sha512-{r(B64, 86)}=="',
        "config": lambda: rng.choice([f'commit_sha = "{r(HEX, 40)}"', f'trace_id: "{r(HEX, 32)}"',
                                      f'key_id = "{r(HEX, 16)}"', f'token_hash = "{r(HEX, 64)}"',
                                      f's3_key = "uploads/{r(DG, 4)}/report_{r(DG, 3)}.pdf"',
                                      f'cache_key("{r(HEX, 32)}")', 'api_version = "2023-06-01-preview"',
                                      f'"etag": "{r(HEX, 32)}"', f'session_timeout_key = "ttl_{r(DG, 4)}"',
                                      f'getToken("refresh_{r(LO, 6)}_v2")', f'--sort-key created_at_{r(DG, 2)}',
                                      'tokenizer = "cl100k_base"', 'api_key_env = "OPENAI_API_KEY"',
                                      'auth_type = "oauth2_client_credentials"', "Authorization: Basic dXNlcjpwYXNzd29yZA==",
                                      f'gpg_key_id = "{r(HEX.upper(), 16)}"', 'token: "{{ .Values.token }}"',
                                      f'idempotency_key = "{"-".join(r(HEX, k) for k in (8, 4, 4, 4, 12))}"',
                                      "--token-file /run/secrets/token", 'password = "<%= ENV[\'DB_PASSWORD\'] %>"']),
        "prose": lambda: rng.choice(PROSE),
        "placeholder": lambda: rng.choice(PLACEHOLDERS),
        "url": lambda: f"https://github.com/acme/atlas/blob/{r(HEX, 40)}/README.md",
    }
    return [(kind, maker() + "\n") for kind, maker in makers.items() for _ in range(n)]


def transcript(rng, size, pos, neg):
    """About `size` bytes of transcript: benign lines with a secret every ~40 lines."""
    parts, total = [], 0
    while total < size:
        line = rng.choice(pos)[1] if rng.random() < 0.025 else rng.choice(neg)[1]
        parts.append(line)
        total += len(line.encode())
    return "".join(parts)


def measure(n, seed, repeat, mb=1.0):
    rng = random.Random(seed)
    pos, neg = positives(rng, n), negatives(rng, n)
    fam = {}
    for family, text, values in pos:
        out = memshelf.redact(text)[0]
        hit = all(v not in out for v in values)
        caught, total = fam.get(family, (0, 0))
        fam[family] = (caught + hit, total + 1)
    fp = {}
    for kind, text in neg:
        changed = memshelf.redact(text)[0] != text
        bad, total = fp.get(kind, (0, 0))
        fp[kind] = (bad + changed, total + 1)
    text = transcript(rng, int(mb * 1_000_000), pos, neg)
    mb = len(text.encode()) / 1e6
    wall, cpu = [], []   # CPU time is the figure: this machine's wall clock is shared
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        memshelf.redact(text)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    lines = text.splitlines(keepends=True)
    parts = [(f"section:{i}", "".join(lines[i::8])) for i in range(8)]
    c0 = time.process_time()
    if hasattr(memshelf, "redact_parts"):   # older code (--code) redacts part by part
        memshelf.redact_parts(parts)
    else:
        [memshelf.redact(t) for _p, t in parts]
    parts_time = time.process_time() - c0
    return {"seed": seed, "per_format": n,
            "recall": {k: {"caught": c, "total": t, "rate": c / t} for k, (c, t) in fam.items()},
            "false_positives": {k: {"changed": b, "total": t, "rate": b / t} for k, (b, t) in fp.items()},
            "recall_all": sum(c for c, _ in fam.values()) / sum(t for _, t in fam.values()),
            "recall_prefixed": sum(fam[f][0] for f in PREFIXED) / sum(fam[f][1] for f in PREFIXED),
            "fp_rate": sum(b for b, _ in fp.values()) / sum(t for _, t in fp.values()),
            "transcript_mb": round(mb, 3), "cpu_seconds_per_mb": statistics.median(cpu) / mb,
            "wall_seconds_per_mb": statistics.median(wall) / mb,
            "parts_seconds_per_mb": parts_time / mb}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20, help="samples per format and negative kind (20)")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs over the transcript")
    ap.add_argument("--mb", type=float, default=1.0, help="transcript size in MB (1.0)")
    ap.add_argument("--json", action="store_true", help="print the result object as JSON")
    ap.add_argument("--code", default=ROOT, help="folder holding the memshelf.py to measure")
    a = ap.parse_args(argv)
    global memshelf
    sys.path.insert(0, os.path.abspath(a.code))
    import memshelf
    res = measure(a.n, a.seed, a.repeat, a.mb)
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print("| family | caught | recall |\n|---|---|---|")
    for k, v in res["recall"].items():
        print(f"| {k} | {v['caught']}/{v['total']} | {v['rate']:.1%} |")
    print(f"| **all** | | **{res['recall_all']:.1%}** (prefixed formats {res['recall_prefixed']:.1%}) |")
    print("\n| negatives | changed | FP rate |\n|---|---|---|")
    for k, v in res["false_positives"].items():
        print(f"| {k} | {v['changed']}/{v['total']} | {v['rate']:.1%} |")
    print(f"| **all** | | **{res['fp_rate']:.1%}** |")
    print(f"\nredact: {res['cpu_seconds_per_mb']:.3f} s/MB CPU, {res['wall_seconds_per_mb']:.3f} s/MB "
          f"wall (median of {a.repeat}, {res['transcript_mb']} MB transcript); redact_parts over "
          f"8 parts: {res['parts_seconds_per_mb']:.3f} s/MB CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
