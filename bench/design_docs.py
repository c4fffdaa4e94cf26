"""A small shelf of realistic design-doc episodes for the natural-language question set.

`bench/questions.tsv` asks questions a user would type about these episodes, each with the
episode and section that holds the answer (`id § Section`). `build(root)` shelves them into a
new shelf; `bench/run.py --cases questions` and tests/test_search.py measure section hit@1/@5
with `memshelf search-bench` on it. The text is written for this benchmark.
"""
import os
import sys

EPISODES = [
    dict(slug="2026-03-02-pg16-upgrade", kind="topic", date="2026-03-02",
         display_title="Postgres 16 upgrade of the billing cluster",
         tags=["postgres", "database", "billing"],
         digest="The database team upgrades the billing cluster from Postgres 15 to 16 in place "
                "with pg_upgrade in link mode during a two-hour Sunday window. Open: PostGIS "
                "extension version on the replicas.",
         sections={
             "Decisions": "Run pg_upgrade --link on the primary; the replicas are rebuilt from "
                          "a fresh base backup afterwards. The maintenance window is Sunday "
                          "02:00-04:00 UTC, announced to customers seven days ahead. Rollback "
                          "point: the pre-upgrade snapshot of the data volume.",
             "Rejected alternatives": "Logical replication to a new 16 cluster: the schema "
                                      "has 400 sequences and large objects, which logical "
                                      "replication does not copy. A dump and restore took "
                                      "six hours on the staging copy of the database.",
             "Artifacts": "- runbooks/pg16-upgrade.md (step-by-step upgrade runbook)\n"
                          "- scripts/pg-upgrade-check.sh (a dry run of the upgrade on a clone)\n"
                          "- dashboards: billing-db replication lag",
             "Open threads": "- PostGIS 3.3 on the replicas must move to 3.4 before the "
                             "upgrade; owner: Dana.\n- Decide whether to keep the 15 binaries "
                             "installed for a week.",
         }),
    dict(slug="2026-03-10-asm-operand-lowering", kind="topic", date="2026-03-10",
         display_title="Inline assembly operand lowering to LLVM",
         tags=["compiler", "llvm", "codegen"],
         digest="The compiler team fixed how inline assembly operands lower to LLVM constraint "
                "strings, including tied inout operands and late outputs. Open: register "
                "classes on RISC-V.",
         sections={
             "Decisions": "An inout(reg) operand lowers to an output constraint =&r plus a "
                          "tied input constraint 0 that names the output's index. An out(reg) "
                          "operand becomes =r; lateout(reg) becomes =r without the early-clobber "
                          "flag. in(reg) becomes r. Explicit registers use {rax} syntax.",
             "Rejected alternatives": "Emitting a +r read-write constraint was rejected: "
                                      "LLVM accepts +r only on some targets, and the constraint "
                                      "string then depends on the target. Splitting every "
                                      "constraint into separate in and out constraints without "
                                      "tying them broke register allocation in two tests. A "
                                      "constraint cache per function was not worth it.",
             "Timeline": "- 2026-03-04: miscompile reported in the crypto crate.\n"
                         "- 2026-03-08: fix merged with 41 new codegen tests.",
             "Open threads": "- RISC-V register classes (freg, vreg) still map to a generic "
                             "constraint; owner: Ilya.",
         }),
    dict(slug="2026-04-01-api-rate-limiter", kind="topic", date="2026-04-01",
         display_title="API rate limiter",
         tags=["api", "redis", "reliability"],
         digest="The platform team rate-limits the public API with a token bucket per API key, "
                "kept in Redis and updated by one Lua script. Open: per-tenant overrides.",
         sections={
             "Decisions": "Token bucket per API key: 100 requests per second refill, burst of "
                          "200. The bucket lives in Redis and one Lua script refills and takes a "
                          "token atomically. Over the limit the API answers 429 with a "
                          "Retry-After header in seconds.",
             "Rejected alternatives": "A sliding window log kept one entry per request and "
                                      "needed 40 GB of Redis memory at peak. A fixed window "
                                      "counter let clients send double the limit at the "
                                      "window edge.",
             "Artifacts": "- services/gateway/ratelimit.lua\n- docs/api/rate-limits.md",
             "Open threads": "- Per-tenant overrides for enterprise plans; owner: Priya.\n"
                             "- Whether internal services bypass the limiter.",
         }),
    dict(slug="2026-04-15-feature-flag-service", kind="topic", date="2026-04-15",
         display_title="Feature flag service",
         tags=["feature-flags", "frontend", "backend"],
         digest="The web team replaced config-file toggles with a feature flag service that "
                "clients evaluate locally from a cached rule set. Open: flag cleanup policy.",
         sections={
             "Decisions": "Clients fetch the full rule set and evaluate flags locally; the "
                          "cache refreshes every 30 seconds and survives a service outage. "
                          "Every flag has an owner and a kill switch. Percentage rollouts hash "
                          "the user id with the flag name.",
             "Artifacts": "Flags created at launch: checkout.new_tax_engine, search.fuzzy_v2, "
                          "billing.invoice_pdf_v3, onboarding.short_form. The SDK lives in "
                          "packages/flags-sdk.",
             "Rejected alternatives": "Server-side evaluation per request added 8 ms p99 to "
                                      "every page and made the flag service a hard dependency.",
             "Open threads": "- A cleanup policy for flags older than 90 days; owner: Marco.",
         }),
    dict(slug="2026-05-02-log-retention", kind="research", date="2026-05-02",
         display_title="Log retention and storage cost",
         tags=["logging", "compliance", "cost"],
         digest="Hana compared log storage tiers for the audit and application logs and "
                "estimated the yearly cost of each retention policy.",
         sections={
             "Findings": "Audit logs must be kept for 13 months for SOC 2. Application logs "
                         "are searched almost only in the first 14 days. Moving logs older "
                         "than 30 days to S3 Glacier Instant Retrieval cuts storage cost by "
                         "about 68 percent against keeping them in the hot Elasticsearch tier.",
             "Decisions": "Application logs: 30 days hot, then deleted. Audit logs: 30 days "
                          "hot, then Glacier Instant Retrieval until 13 months, then deleted.",
             "Open threads": "- Legal has not confirmed whether 13 months covers the German "
                             "subsidiary.",
         }),
    dict(slug="2026-05-20-kafka-consumer-lag", kind="session", date="2026-05-20",
         display_title="Incident: orders consumer lag",
         tags=["incident", "kafka", "orders"],
         digest="Omar handled an incident in which the orders consumer group fell two hours "
                "behind because slow batches exceeded the poll interval and triggered "
                "rebalances. Open: alert threshold.",
         sections={
             "Timeline": "- 14:02 lag alert on the orders consumer group.\n- 14:20 consumers "
                         "restarted; the rebalance loop continued.\n- 15:05 root cause found: "
                         "batches of 500 records took longer than max.poll.interval.ms "
                         "(300000), so the broker evicted consumers and rebalanced.\n- 15:30 "
                         "max.poll.records lowered to 100; lag drained by 16:10.",
             "Decisions": "Keep max.poll.records at 100 and move the slow enrichment call "
                          "out of the consumer into a separate worker.",
             "Open threads": "- Alert on lag in seconds, not messages; owner: Omar.\n- Add a "
                             "dashboard for rebalance counts.",
         }),
    dict(slug="2026-06-03-session-tokens", kind="topic", date="2026-06-03",
         display_title="Opaque session tokens instead of JWTs",
         tags=["auth", "security"],
         digest="The identity team replaced JWT access tokens with opaque session tokens "
                "stored hashed in the database, so a session can be revoked at once. Open: "
                "mobile refresh flow.",
         sections={
             "Decisions": "Session tokens are 32 random bytes, base64url encoded. Only the "
                          "SHA-256 hash is stored in the sessions table. Sessions expire after "
                          "12 hours of inactivity (sliding expiry) and after 30 days at most.",
             "Rejected alternatives": "JWTs with a revocation list: every service would need "
                                      "the list, which defeats stateless verification. Short "
                                      "JWT lifetimes of 5 minutes multiplied refresh traffic.",
             "Open threads": "- The mobile apps still refresh with the old JWT flow; owner: "
                             "Lena.",
         }),
    dict(slug="2026-06-18-ci-build-cache", kind="topic", date="2026-06-18",
         display_title="CI build cache",
         tags=["ci", "build", "bazel"],
         digest="The developer-productivity team added a Bazel remote cache to CI, which cut "
                "the median pipeline from 38 to 11 minutes. Open: flaky test quarantine.",
         sections={
             "Decisions": "A Bazel remote cache on a GCS bucket in the CI region; cache keys "
                          "include the toolchain hash, so a compiler bump never reuses old "
                          "artifacts. Entries expire after 14 days. Developer laptops read the "
                          "cache but never write to it.",
             "Timeline": "- 2026-06-02: cache enabled for the backend monorepo.\n- 2026-06-10: "
                         "median pipeline time down from 38 to 11 minutes.",
             "Open threads": "- Quarantine flaky tests automatically after three failures in "
                             "a week; owner: Sam.",
         }),
    dict(slug="2026-07-01-mobile-release-train", kind="topic", date="2026-07-01",
         display_title="Mobile release train",
         tags=["mobile", "release"],
         digest="The mobile team ships on a two-week release train with a Wednesday code "
                "freeze and a phased store rollout gated on the crash-free rate.",
         sections={
             "Decisions": "A release branch is cut every second Wednesday at 12:00 (code "
                          "freeze). The store rollout goes 1 percent, 10 percent, 50 percent, "
                          "100 percent over seven days and pauses when the crash-free session "
                          "rate drops below 99.5 percent.",
             "Rejected alternatives": "Weekly releases doubled the QA load; releasing on "
                                      "demand made the support team unable to tell which "
                                      "version a customer ran.",
             "Open threads": "- Hotfix policy for the weekend; owner: Kenji.",
         }),
    dict(slug="2026-07-14-date-formatting", kind="topic", date="2026-07-14",
         display_title="Dates and time zones in the web app",
         tags=["i18n", "frontend"],
         digest="The web team standardised date handling: timestamps are stored in UTC and "
                "rendered in the user's time zone with the browser's Intl API. Open: "
                "recurring events across DST changes.",
         sections={
             "Decisions": "Store every timestamp as UTC in the database and in APIs (ISO 8601 "
                          "with Z). Render with Intl.DateTimeFormat in the user's profile time "
                          "zone, falling back to the browser's zone.",
             "Rejected alternatives": "moment.js and moment-timezone add 70 KB to the bundle "
                                      "and are in maintenance mode. Storing local times with "
                                      "an offset broke sorting across zones.",
             "Open threads": "- Recurring meetings across daylight saving time changes; "
                             "owner: Aiko.",
         }),
]


def build(root, code=None, episodes=None):
    """A new plain shelf at root holding `episodes` (EPISODES by default); returns root."""
    if code:
        sys.path.insert(0, code)
    import memshelf
    memshelf.init(str(root), storage="plain")
    for ep in EPISODES if episodes is None else episodes:
        memshelf.shelve(str(root), **ep)
    return str(root)


if __name__ == "__main__":
    build(sys.argv[1], os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
