#!/usr/bin/env python3
"""Deterministic synthetic shelf for the benchmarks (bench/README.md § Method).

Flow: `memshelf.py init` once (config files exactly as init writes them) -> episode files
written directly in the byte format shelve writes (H1-first, frontmatter in field order) ->
`memshelf.py rebuild` once for the derived files -> optional single git commit.
Next to the shelf goes queries.tsv (`query<TAB>expected-id<TAB>label`), whose answers are
known by construction: every queried episode carries a planted term nothing else carries.

    python3 bench/gen_shelf.py --n 10000 --seed 1 --out /tmp/shelf10k [--git]
"""
import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import time

GENERATOR_VERSION = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LABELS = ("exact-id", "keyword", "cjk", "cyrillic", "paraphrase")
FIRST_DAY = datetime.date(2024, 1, 1)
DAYS = 730  # two years of work
GIT_ENV = {"GIT_AUTHOR_NAME": "memshelf bench", "GIT_AUTHOR_EMAIL": "bench@example.invalid",
           "GIT_COMMITTER_NAME": "memshelf bench", "GIT_COMMITTER_EMAIL": "bench@example.invalid",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00"}

# --- vocabulary --------------------------------------------------------------------------
# (canonical wording in the episode, paraphrase wording in queries); the two share no content word
COMPONENTS = [
    ("authentication middleware", "login gatekeeping layer"),
    ("session cache", "short-lived user state store"),
    ("billing worker", "invoice processing daemon"),
    ("search indexer", "full-text lookup builder"),
    ("payment gateway", "card charging bridge"),
    ("rate limiter", "request throttle"),
    ("job scheduler", "cron-style task runner"),
    ("feature flags", "runtime toggles"),
    ("audit log", "compliance trail"),
    ("image resizer", "thumbnail generator"),
    ("email relay", "outbound mail forwarder"),
    ("backup pipeline", "nightly snapshot process"),
    ("build runner", "continuous integration executor"),
    ("schema migration", "database layout change"),
    ("metrics exporter", "telemetry publisher"),
    ("websocket hub", "realtime push channel"),
    ("config loader", "settings reader"),
    ("PDF renderer", "printable document producer"),
    ("geo lookup", "location resolver"),
    ("webhook dispatcher", "callback sender"),
]
PROBLEMS = [
    ("memory leak", "growing RAM usage"),
    ("timeout spikes", "requests hanging far too long"),
    ("duplicate writes", "records saved twice"),
    ("slow cold start", "sluggish first boot"),
    ("stale reads", "outdated data returned"),
    ("deadlock", "threads blocking each other forever"),
    ("flaky tests", "unreliable automated checks"),
    ("disk pressure", "storage volume filling up"),
    ("clock skew", "time drift between hosts"),
    ("retry storm", "cascade of repeated attempts"),
    ("encoding errors", "garbled characters"),
    ("permission drift", "access rights diverging"),
    ("queue backlog", "pending work piling up"),
    ("cache stampede", "simultaneous recomputation herd"),
    ("TLS handshake failures", "secure connection setup breaking"),
]
DECISIONS = [
    ("exponential backoff", "increasingly spaced retries"),
    ("connection pooling", "reusing open sockets"),
    ("idempotency keys", "request dedup markers"),
    ("read replicas", "secondary query copies"),
    ("a circuit breaker", "an automatic failure cutoff"),
    ("batch inserts", "grouped row writes"),
    ("lazy loading", "deferred initialization"),
    ("blue-green deploys", "parallel environment switchover"),
    ("a write-ahead log", "journaling before commit"),
    ("sharding by tenant", "per-customer partitioning"),
    ("LRU eviction", "dropping least recently touched entries"),
    ("schema versioning", "numbered layout revisions"),
]
ALTERNATIVES = ["a full rewrite", "a vendor service", "manual failover", "a bigger instance",
                "a nightly cron job", "per-route decorators", "a shared mutex", "polling",
                "a second datacenter", "client-side caching"]
OPEN_ITEMS = ["load test at peak traffic", "runbook update", "dashboard alerts",
              "rollback drill", "docs for the on-call rotation", "capacity review",
              "cleanup of the old code path", "owner sign-off"]
ACTORS = ["Alice", "Bogdan", "Chen Wei", "Dana", "Elif", "Farid", "Greta", "Hiro", "Ines",
          "Jonas", "Katya", "Luis", "Mei", "Noor", "Olek", "Priya", "Rafael", "Sanna"]
TAGS = ["auth", "cache", "billing", "infra", "frontend", "backend", "perf", "security", "ci",
        "db", "api", "mobile", "docs", "ops", "search", "release"]
TAG_PAIRS = ["priority:high", "priority:low", "team:platform", "team:payments", "area:storage",
             "status:done", "status:follow-up"]
TICKET_PREFIXES = ["PAY", "AUTH", "OPS", "WEB", "DATA", "INFRA", "MOB", "SEC", "API", "UX"]
SYLLABLES = ["ka", "ve", "lo", "mi", "zu", "ra", "no", "si", "te", "po", "du", "ga", "fe",
             "bi", "xo", "ri", "sa", "tu", "me", "ko", "ny", "qa", "wo", "ji"]
# planted Chinese words (queries concatenate three, no spaces) and filler that uses none of them
ZH_WORDS = ["缓存", "索引", "队列", "网关", "日志", "证书", "副本", "分片", "限流", "熔断", "回滚",
            "部署", "镜像", "容器", "集群", "节点", "延迟", "吞吐", "压缩", "加密", "签名", "令牌",
            "会话", "权限", "审计", "备份", "快照", "迁移", "调度", "监控", "告警", "指标", "配置",
            "依赖", "构建", "发布", "版本", "接口", "协议", "编码"]
ZH_FILLER = ["本周团队讨论了方案的优缺点，并记录了后续需要跟进的事项。",
             "评审会上大家对时间安排没有异议。",
             "负责人确认了上线窗口，风险点已经写进文档。",
             "现有做法在高峰期表现一般，需要进一步观察。",
             "相关同事补充了背景资料，结论见下文。",
             "这次调整的范围较小，预计影响有限。"]
# planted Russian nouns: (form written in the episode, form used in the query)
RU_NOUNS = [("миграции", "миграция"), ("репликации", "репликация"),
            ("балансировки", "балансировка"), ("кэширования", "кэширование"),
            ("индексации", "индексация"), ("авторизации", "авторизация"),
            ("сериализации", "сериализация"), ("шифрования", "шифрование"),
            ("развертывания", "развертывание"), ("журналирования", "журналирование"),
            ("хранилища", "хранилище"), ("очереди", "очередь"), ("планировщика", "планировщик"),
            ("сертификата", "сертификат"), ("контейнера", "контейнер"), ("кластера", "кластер"),
            ("платформы", "платформа"), ("библиотеки", "библиотека"),
            ("интерфейса", "интерфейс"), ("протокола", "протокол"),
            ("мониторинга", "мониторинг"), ("тестирования", "тестирование"),
            ("задержки", "задержка"), ("нагрузки", "нагрузка"), ("проверки", "проверка"),
            ("настройки", "настройка"), ("сессии", "сессия"), ("транзакции", "транзакция"),
            ("конфигурации", "конфигурация"), ("документации", "документация"),
            ("резервирования", "резервирование"), ("маршрутизации", "маршрутизация"),
            ("валидации", "валидация"), ("синхронизации", "синхронизация"),
            ("агрегации", "агрегация"), ("фильтрации", "фильтрация"),
            ("оптимизации", "оптимизация"), ("компрессии", "компрессия"),
            ("аутентификации", "аутентификация"), ("трассировки", "трассировка")]
RU_FILLER = ["Команда обсудила варианты и зафиксировала итоги встречи.",
             "Ответственный подтвердил сроки, риски описаны ниже.",
             "Решение принято после короткого обсуждения.",
             "Дальнейшие шаги согласованы с владельцем сервиса.",
             "Старый подход работал медленно в часы пик.",
             "Коллеги добавили контекст и ссылки на обсуждение."]
TITLE_EXTRA = ["方案评审", "上线复盘", "Итоги обсуждения", "Разбор инцидента"]
FINDINGS = ["Throughput rose by {a}% with the new setting.",
            "p99 latency dropped from {a} ms to {b} ms.",
            "The error rate stayed below 0.{a}% during the trial.",
            "Memory use settled at {a} MB per worker.",
            "Two of {a} replicas lagged by more than {b} seconds."]
LOG_WORDS = ["worker", "scheduler", "api", "db", "cache", "queue", "indexer", "gateway",
             "mailer", "exporter", "renderer", "loader"]


def _check_vocabulary():
    """Planted terms must not occur in filler text, or the expected answers stop being unique."""
    filler = "".join(ZH_FILLER + TITLE_EXTRA)
    assert not [w for w in ZH_WORDS if w in filler], "Chinese filler uses a planted word"
    ru = " ".join(RU_FILLER + TITLE_EXTRA).lower()
    assert not [w for w, _ in RU_NOUNS if w[:-2] in ru], "Russian filler uses a planted stem"


_check_vocabulary()


# --- building blocks ----------------------------------------------------------------------

def yaml_quote(value):
    """Free text as shelve writes it: whitespace collapsed, double-quoted, \\ and \" escaped."""
    return '"' + " ".join(value.split()).replace("\\", "\\\\").replace('"', '\\"') + '"'


def codename(i):
    """A unique made-up word per episode index (never an English word)."""
    out, n = "", i
    for _ in range(3):
        out += SYLLABLES[n % len(SYLLABLES)]
        n //= len(SYLLABLES)
    while n:
        out += SYLLABLES[n % len(SYLLABLES)]
        n //= len(SYLLABLES)
    return "q" + out  # 'q' + syllables: no collision with real words


def _base36(i):
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        out = digits[i % 36] + out
        i //= 36
        if not i:
            return out


def _ticket_space(n):
    for space in (9000, 90000, 900000, 9000000):
        if n <= space:
            return space
    raise ValueError("too many episodes")


def ticket(i, space):
    """Globally unique ticket per episode: prefix by i % 10, number by a bijection of i."""
    return f"{TICKET_PREFIXES[i % len(TICKET_PREFIXES)]}-{1000 + (i * 7919) % space}"


def _raw_line_pool(rng, size=4000):
    """Log, shell and JSON lines for Raw excerpts; no credential or instruction shapes."""
    pool = []
    for _ in range(size):
        kind = rng.random()
        day = FIRST_DAY + datetime.timedelta(days=rng.randrange(DAYS))
        stamp = f"{day}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}Z"
        who = rng.choice(LOG_WORDS)
        if kind < 0.45:
            level = rng.choice(["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"])
            pool.append(f"{stamp} {level} {who}[{rng.randrange(1, 16)}]: processed "
                        f"{rng.randrange(10, 5000)} items in {rng.randrange(1, 2000)}ms "
                        f"(batch {rng.randrange(1, 900)}, retries {rng.randrange(0, 4)})")
        elif kind < 0.6:
            pool.append(rng.choice([
                f"$ kubectl -n {who} get pods -o wide | grep -c Running",
                f"$ git log --oneline -n {rng.randrange(3, 30)} -- services/{who}/",
                f"$ curl -s http://localhost:{rng.randrange(3000, 9999)}/healthz",
                f"$ psql -c 'select count(*) from {who}_jobs where state = 1'",
                f"$ make test SERVICE={who} SHARD={rng.randrange(1, 9)}",
                f"$ du -sh /var/lib/{who}/data"]))
        elif kind < 0.8:
            path = f"/v{rng.randrange(1, 4)}/{who}/{rng.randrange(1, 999)}"
            pool.append(json.dumps({"ts": stamp, "svc": who, "latency_ms": rng.randrange(1, 900),
                                    "status": rng.choice([200, 200, 200, 404, 500, 503]),
                                    "path": path}))
        elif kind < 0.92:
            pool.append(rng.choice([
                f"    def handle_{who}(self, batch):",
                f"        if len(batch) > {rng.randrange(10, 500)}:",
                f"            return self.{who}.flush(timeout={rng.randrange(1, 60)})",
                f"    for item in pending[:{rng.randrange(5, 100)}]:",
                f"        metrics.observe('{who}.latency', elapsed)",
                "        raise RetryLater(item.id)"]))
        elif kind < 0.96:
            pool.append(rng.choice(ZH_FILLER))
        else:
            pool.append(rng.choice(RU_FILLER))
    return pool


class _Plan:
    """Per-episode choices made before any text is written (queried terms are reserved)."""
    __slots__ = ("i", "kind", "day", "comp", "prob", "dec", "zh", "ru", "slug")


def _plan(n, rng):
    plans = []
    for i in range(n):
        p = _Plan()
        p.i = i
        r = rng.random()
        p.kind = "topic" if r < 0.5 else ("research" if r < 0.75 else "session")
        p.day = FIRST_DAY + datetime.timedelta(days=rng.randrange(DAYS))
        p.comp = p.prob = p.dec = None
        p.zh = rng.random() < 0.35
        p.ru = rng.random() < 0.30
        plans.append(p)
    return plans


def _queries_per_label(n):
    return max(5, min(200, n // 20))


def _assign_terms(plans, rng, q):
    """Reserve unique planted terms for queried episodes; everybody else draws from the rest."""
    queried = {}
    everyone = list(range(len(plans)))
    for label in LABELS:
        pool = everyone
        if label == "cjk":
            pool = [p.i for p in plans if p.zh]
        elif label == "cyrillic":
            pool = [p.i for p in plans if p.ru]
        queried[label] = sorted(rng.sample(pool, min(q, len(pool))))
    # paraphrase: a (component, problem, decision) combination only the queried episode has
    combos = [(c, p, d) for c in range(len(COMPONENTS)) for p in range(len(PROBLEMS))
              for d in range(len(DECISIONS))]
    reserved = rng.sample(combos, len(queried["paraphrase"]))
    for i, combo in zip(queried["paraphrase"], reserved):
        plans[i].comp, plans[i].prob, plans[i].dec = combo
    taken = set(reserved)
    for p in plans:
        if p.comp is None:
            while True:
                combo = (rng.randrange(len(COMPONENTS)), rng.randrange(len(PROBLEMS)),
                         rng.randrange(len(DECISIONS)))
                if combo not in taken:
                    break
            p.comp, p.prob, p.dec = combo
    # Chinese: an ordered word triple written contiguously; Russian: a noun set
    zh_taken = set()
    for i in queried["cjk"]:
        while True:
            t = tuple(rng.sample(range(len(ZH_WORDS)), 3))
            if t not in zh_taken:
                break
        zh_taken.add(t)
        plans[i].zh = t
    ru_taken = set()
    for i in queried["cyrillic"]:
        while True:
            t = tuple(sorted(rng.sample(range(len(RU_NOUNS)), 3)))
            if t not in ru_taken:
                break
        ru_taken.add(t)
        plans[i].ru = t
    for p in plans:
        if p.zh is True:
            while True:
                t = tuple(rng.sample(range(len(ZH_WORDS)), 3))
                if t not in zh_taken:
                    break
            p.zh = t
        if p.ru is True:
            while True:
                t = tuple(sorted(rng.sample(range(len(RU_NOUNS)), 3)))
                if t not in ru_taken:
                    break
            p.ru = t
    return queried


def _slug(p):
    words = COMPONENTS[p.comp][0].lower()
    words = "-".join("".join(ch if ch.isalnum() else " " for ch in words).split())
    return f"{p.day.isoformat()}-{words}-{_base36(p.i)}"


def _raw_excerpts(rng, pool, mean_bytes):
    if mean_bytes <= 0 or rng.random() < 0.1:
        return None
    target = max(200, int(rng.expovariate(1.0 / mean_bytes) * 0.5 + mean_bytes * 0.5))
    lines = rng.choices(pool, k=max(2, target // 70))
    fence = rng.choice(["```text", "```log", "```", "```json"])
    return fence + "\n" + "\n".join(lines) + "\n```"


def _episode(p, rng, pool, raw_bytes, tickets, ids, long_descriptions=False):
    """Compose one episode exactly as shelve writes it (docs/format.md § Episodes)."""
    comp, prob, dec = COMPONENTS[p.comp][0], PROBLEMS[p.prob][0], DECISIONS[p.dec][0]
    a, b = rng.sample(ACTORS, 2)
    tk = tickets[p.i]
    code = codename(p.i)
    alt = rng.choice(ALTERNATIVES)
    open_item = rng.choice(OPEN_ITEMS)
    first = f"{a} chose {dec} for the {comp} ({tk})."
    digest = (f"{first} {b} rejected {alt} after {prob} showed up under load. "
              f"{a} measured the change on staging before the rollout. Open: {open_item}.")
    description = None
    if rng.random() < 0.3:
        description = f"{comp[0].upper() + comp[1:]}: {dec} against {prob}"
    zh = ru = ""
    if p.zh:
        zh = ("备注：" + rng.choice(ZH_FILLER) + "".join(ZH_WORDS[w] for w in p.zh) +
              "相关的改动已经合并。" + rng.choice(ZH_FILLER))
    if p.ru:
        w = [RU_NOUNS[k][0] for k in p.ru]
        rng.shuffle(w)
        ru = (f"Заметка: {rng.choice(RU_FILLER)} Обсуждали вопросы {w[0]}, {w[1]} и {w[2]}. "
              f"{rng.choice(RU_FILLER)}")
    other = tickets[rng.randrange(len(tickets))] if rng.random() < 0.1 else None
    sections = []
    findings = None
    if p.kind == "topic":
        dec_lines = [f"- {dec.capitalize()} for the {comp}; {alt} rejected ({tk}).",
                     f"- Rollout codename {code}, behind a flag for one week.",
                     f"- {b} owns the follow-up on {prob}."]
        if zh:
            dec_lines.append("- " + zh)
        if ru:
            dec_lines.append("- " + ru)
        sections.append(("Decisions", "\n".join(dec_lines)))
    elif p.kind == "session":
        steps = [f"1. {a} reproduced the {prob} in the {comp} ({tk}).",
                 f"2. {b} tried {alt}; it did not help.",
                 f"3. Switched to {dec}; codename {code} for the branch.",
                 f"4. Staging ran clean for {rng.randrange(2, 48)} hours."]
        if other:
            steps.append(f"5. Cross-checked with {other}.")
        if zh:
            steps.append(zh)
        if ru:
            steps.append(ru)
        sections.append(("Timeline", "\n".join(steps)))
    else:
        lines = [f"Question: does {dec} stop the {prob} in the {comp}? ({tk})",
                 f"Codename {code} marks the trial branch."]
        lines += [rng.choice(FINDINGS).format(a=rng.randrange(2, 90), b=rng.randrange(1, 60))
                  for _ in range(rng.randrange(2, 5))]
        if zh:
            lines.append(zh)
        if ru:
            lines.append(ru)
        findings = "\n\n".join(lines)
    if p.kind != "research" and rng.random() < 0.4:
        sections.append(("Artifacts", f"- services/{comp.split()[0].lower()}/config.yml\n"
                                      f"- PR #{rng.randrange(100, 9999)}"))
    if p.kind == "session" or rng.random() < 0.5:
        threads = [f"- {open_item.capitalize()} ({b})."]
        if other and p.kind != "session":
            threads.append(f"- Related: {other}.")
        sections.append(("Open threads", "\n".join(threads)))
    raw = _raw_excerpts(rng, pool, raw_bytes)
    if raw:
        sections.append(("Raw excerpts", raw))
    if findings:
        sections.append(("Findings", findings))
        if rng.random() < 0.5:
            sections.append(("Sources", f"- Benchmark notes for {tk}\n- Vendor docs, "
                                        f"section {rng.randrange(1, 20)}"))
    tags = rng.sample(TAGS, rng.randrange(1, 4))
    if rng.random() < 0.5:
        tags.append(rng.choice(TAG_PAIRS))
    date = p.day.isoformat()
    span = date
    if p.kind == "session" and rng.random() < 0.5:
        span = f"{(p.day - datetime.timedelta(days=rng.randrange(1, 5))).isoformat()}..{date}"
    fm = [f"id: {p.slug}", f"kind: {p.kind}"]
    if p.kind == "session":
        fm.append(f"session: {yaml_quote('sess-%08x' % rng.getrandbits(32))}")
    if rng.random() < 0.5:
        fm.append(f"agent: {yaml_quote(rng.choice(['claude-code', 'claude-desktop', 'codex']))}")
    fm += [f"span: {span}", f"date: {date}"]
    if rng.random() < 0.05:
        fm.append(f"retain_until: {(p.day + datetime.timedelta(days=900)).isoformat()}")
    if rng.random() < 0.35:
        title = f"{comp[0].upper() + comp[1:]}: {dec}"
        if rng.random() < 0.15:
            title += " — " + rng.choice(TITLE_EXTRA)
        fm.append(f"display_title: {yaml_quote(title)}")
    if long_descriptions:   # ~150 characters, as hand-written ones are (issue 28); no rng draw
        description = (f"{comp[0].upper() + comp[1:]}: {dec} against {prob}; {a} measured it "
                       f"on staging before the rollout, {b} owns {open_item}")
    fm.append(f"description: {yaml_quote(description or first)}")
    fm.append(f"tags: [{', '.join(tags)}]")
    if p.i > 10 and rng.random() < 0.02:
        older = ids[rng.randrange(p.i)]
        fm.append(f"supersedes: [{older}]")
    approx = rng.randrange(3000, 60000)
    fm += [f"approx_tokens: {approx}",
           f"approx_tokens_source: {'measured' if rng.random() < 0.3 else 'estimate'}",
           f"mode: {'import' if rng.random() < 0.1 else 'live'}"]
    if rng.random() < 0.1:
        fm.append(f"notes: {yaml_quote('imported from an exported transcript')}")
    out = [f"# {p.slug}", "", "---"] + fm + ["---", "", "## Digest", digest]
    for name, body in sections:
        out += ["", f"## {name}", body.strip()]
    return "\n".join(out) + "\n"


def _queries(plans, queried, tickets):
    rows = []
    for n, i in enumerate(queried["exact-id"]):
        rows.append((tickets[i] if n % 2 == 0 else plans[i].slug, plans[i].slug, "exact-id"))
    for i in queried["keyword"]:
        word = PROBLEMS[plans[i].prob][0].split()[-1].lower()
        rows.append((f"{codename(i)} {word}", plans[i].slug, "keyword"))
    for i in queried["cjk"]:
        rows.append(("".join(ZH_WORDS[w] for w in plans[i].zh), plans[i].slug, "cjk"))
    for i in queried["cyrillic"]:
        rows.append((" ".join(RU_NOUNS[k][1] for k in plans[i].ru), plans[i].slug, "cyrillic"))
    shapes = ["how was the {p} in the {c} handled with {d}",
              "{c} suffering from {p}: settled on {d}",
              "what fixed {p} for the {c} — {d}?"]
    for n, i in enumerate(queried["paraphrase"]):
        pl = plans[i]
        rows.append((shapes[n % len(shapes)].format(c=COMPONENTS[pl.comp][1],
                                                    p=PROBLEMS[pl.prob][1],
                                                    d=DECISIONS[pl.dec][1]),
                     pl.slug, "paraphrase"))
    return rows


# --- shelf skeleton and finishing --------------------------------------------------------

def _run(argv, cwd=None, env=None, check=True):
    full = dict(os.environ)
    full.update(env or {})
    for name in ("MEMSHELF_SHELF", "MEMSHELF_SHELF_PATH", "MEMSHELF_ROOT"):
        full.pop(name, None)
    proc = subprocess.run(argv, cwd=cwd, env=full, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[:500]}")
    return proc


_FALLBACK_POLICY_MD = ("# Redaction policy\n\nCredentials are masked by shelve. Personal data of "
                       "third parties stays off the shelf. Machine rules: POLICY.patterns.\n")
_FALLBACK_PATTERNS = "# one rule per line: <kind> <regex>\n"
_FALLBACK_GITIGNORE = ".DS_Store\n*.swp\n__pycache__/\n.memshelf/\n"


def _skeleton(out, python, code_dir, fmt, git, log):
    """Run memshelf init once; complete what a not-yet-finished init leaves out."""
    memshelf = os.path.join(code_dir, "memshelf.py")
    storage = "git-local" if git else "plain"
    proc = _run([python, memshelf, "init", "--shelf", out, "--storage", storage,
                 "--index-format", fmt, "--quiet"], env=GIT_ENV, check=False)
    if proc.returncode == 0:
        return True
    log(f"gen_shelf: memshelf init failed ({proc.stderr.strip()[:200]}); "
        "completing the shelf skeleton with fallback files")
    for d in ("docs/topics", "docs/research", "docs/sessions"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    gen_by = "external" if fmt == "compact" else "docshelf-mcp"
    fallback = {
        "shelf.yml": ("# shelf.yml — shelf-spec v0 manifest (written by memshelf)\n"
                      'spec_version: "0.1"\nmode: single\nname: "Memory shelf"\nprofile: memory\n'
                      "docs_root: docs\ncategories:\n  - topics\n  - research\n  - sessions\n"
                      f"index:\n  path: INDEX.md\n  generated_by: {gen_by}\n"
                      "ledger:\n  path: ledger.tsv\n"
                      "policy:\n  path: POLICY.md\n  patterns: POLICY.patterns\n"),
        "memshelf.json": '{\n  "derived": "auto"\n}\n',
        "POLICY.md": _FALLBACK_POLICY_MD,
        "POLICY.patterns": _FALLBACK_PATTERNS,
        ".gitignore": _FALLBACK_GITIGNORE,
    }
    for name, text in fallback.items():
        path = os.path.join(out, name)
        if not os.path.exists(path):
            with open(path, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
    if not os.path.exists(os.path.join(out, ".docshelf.json")):
        raise RuntimeError("memshelf init did not write .docshelf.json: "
                           + proc.stderr.strip()[:300])
    if git and not os.path.isdir(os.path.join(out, ".git")):
        _run(["git", "init", "-q"], cwd=out, env=GIT_ENV)
        _run(["git", "symbolic-ref", "HEAD", "refs/heads/main"], cwd=out, env=GIT_ENV)
    return False


def git_commit_all(out, message):
    """One commit of everything pending; hooks off (a pre-commit scan of 100k files is not
    what is being generated)."""
    _run(["git", "add", "-A"], cwd=out, env=GIT_ENV)
    _run(["git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgsign=false", "commit",
          "-q", "--no-verify", "-m", message], cwd=out, env=GIT_ENV)


def generate(out, n=1000, seed=1, raw_kb=6.4, git=False, fmt="compact", queries_path=None,
             python=None, code_dir=None, force=False, log=None, long_descriptions=False):
    """Write a shelf of n episodes at out and queries.tsv next to it; returns a summary dict."""
    log = log or (lambda msg: sys.stderr.write(msg + "\n"))
    python = python or os.path.realpath(sys.executable)
    code_dir = code_dir or REPO
    out = os.path.abspath(out)
    if os.path.exists(out):
        if not force and os.listdir(out):
            raise RuntimeError(f"{out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    if fmt not in ("compact", "docshelf"):
        raise ValueError("format must be compact or docshelf")
    queries_path = queries_path or os.path.join(os.path.dirname(out), "queries.tsv")
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    init_ok = _skeleton(out, python, code_dir, fmt, git, log)
    t_init = time.perf_counter()

    rng = random.Random(seed)
    pool = _raw_line_pool(random.Random(seed * 7919 + 1))
    plans = _plan(n, rng)
    queried = _assign_terms(plans, rng, _queries_per_label(n))
    for p in plans:
        p.slug = _slug(p)
    space = _ticket_space(n)
    tickets = [ticket(i, space) for i in range(n)]
    ids = [p.slug for p in plans]
    dirs = {"topic": "topics", "research": "research", "session": "sessions"}
    total = 0
    for p in plans:
        text = _episode(p, rng, pool, raw_kb * 1024, tickets, ids,
                        long_descriptions).encode("utf-8")
        total += len(text)
        path = os.path.join(out, "docs", dirs[p.kind], p.slug + ".md")
        with open(path, "wb") as f:
            f.write(text)
        # a real shelf's episodes were written over its two years, not in the same second
        noon = datetime.datetime.combine(p.day, datetime.time(12), datetime.timezone.utc)
        os.utime(path, (noon.timestamp(), noon.timestamp()))
    t_write = time.perf_counter()
    _run([python, os.path.join(code_dir, "memshelf.py"), "rebuild", "--shelf", out, "--quiet"],
         env=GIT_ENV)
    cache = os.path.join(out, ".memshelf")
    if os.path.isdir(cache):
        shutil.rmtree(cache)  # a generated shelf starts like a fresh clone: no local cache
    t_rebuild = time.perf_counter()
    if git:
        git_commit_all(out, f"bench: {n} synthetic episodes (seed {seed})")
    t_git = time.perf_counter()
    rows = _queries(plans, queried, tickets)
    with open(queries_path, "w", encoding="utf-8", newline="\n") as f:
        f.write(f"# memshelf bench queries: n={n} seed={seed}; query<TAB>expected-id<TAB>label\n")
        for q, expected, label in rows:
            f.write(f"{q}\t{expected}\t{label}\n")
    kinds = {}
    for p in plans:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    return {"shelf": out, "queries": queries_path, "episodes": n, "seed": seed,
            "raw_kb": raw_kb, "format": fmt, "git": git, "init_complete": init_ok,
            "episode_bytes": total, "kinds": kinds,
            "queries_per_label": {lb: sum(1 for r in rows if r[2] == lb) for lb in LABELS},
            "seconds": {"init": round(t_init - t0, 2), "episodes": round(t_write - t_init, 2),
                        "rebuild": round(t_rebuild - t_write, 2),
                        "git": round(t_git - t_rebuild, 2), "total": round(t_git - t0, 2)},
            "generator_version": GENERATOR_VERSION}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate a deterministic synthetic memshelf shelf.")
    ap.add_argument("--n", type=int, default=1000, help="episodes (1000, 10000, 100000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--raw-kb", type=float, default=6.4, help="mean Raw excerpts size in KB")
    ap.add_argument("--git", action="store_true", help="git-local shelf, episodes in one commit")
    ap.add_argument("--format", choices=("compact", "docshelf"), default="compact",
                    help="INDEX format (shelf.yml generated_by)")
    ap.add_argument("--out", required=True, help="shelf directory to create")
    ap.add_argument("--queries", help="queries.tsv path (default: next to the shelf)")
    ap.add_argument("--code", default=REPO, help="folder holding memshelf.py")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--long-descriptions", action="store_true",
                    help="~150-character descriptions on every episode (bench/index_curve.py)")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be positive")
    try:
        summary = generate(args.out, n=args.n, seed=args.seed, raw_kb=args.raw_kb, git=args.git,
                           fmt=args.format, queries_path=args.queries, code_dir=args.code,
                           force=args.force, long_descriptions=args.long_descriptions)
    except (RuntimeError, ValueError) as exc:
        sys.stderr.write(f"gen_shelf: {exc}\n")
        return 1
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
