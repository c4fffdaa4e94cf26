"""Secret redaction (docs/redaction.md): every built-in kind in realistic contexts, what is not a
secret, precedence and the quote rule, the report, POLICY.patterns, the per-shelf switches
and memshelf-mcp 0.4.0 compatibility (docs/format.md § Interop with memshelf-mcp 0.4.0)."""

import base64
import json
import os
import random
import re
import string
import subprocess
import sys

import pytest

import memshelf
from memshelf import find_secrets, load_policy_patterns, merge_redaction_reports, redact

MASK = re.compile(r"«redacted:([A-Za-z0-9][A-Za-z0-9_.:-]*)»")
BAD_WORDS = ("example", "placeholder", "changeme", "change_me", "change-me", "your", "dummy",
             "redacted", "xxxx", "notreal", "fake")

UPPER, LOWER, DIGITS = string.ascii_uppercase, string.ascii_lowercase, string.digits
ALNUM = UPPER + LOWER + DIGITS
HEX = "0123456789abcdef"
B64 = ALNUM + "+/"
URLSAFE = ALNUM + "_-"

_rng = random.Random(20240613)


def rand(alphabet, n):
    """A random run that reads like a real credential (never a placeholder word)."""
    while True:
        value = "".join(_rng.choice(alphabet) for _ in range(n))
        if not any(w in value.lower() for w in BAD_WORDS) and (len(set(value)) > 3 or n < 6):
            return value


def b64(text):
    return base64.b64encode(text.encode()).decode()


# ------------------------------------------------------------------------------------------
# The corpus: (kind, context, text, secret values that must disappear, words that must stay)
# ------------------------------------------------------------------------------------------

def _corpus():
    s = []

    def add(kind, ctx, text, secrets, keep=()):
        s.append((kind, ctx, text, list(secrets), list(keep)))

    v = "AKIA" + rand(UPPER + DIGITS, 16)
    add("aws-access-key", "shell", f"export AWS_ACCESS_KEY_ID={v}\n", [v], ["AWS_ACCESS_KEY_ID"])
    v = "ASIA" + rand(UPPER + DIGITS, 16)
    add("aws-access-key", "log",
        f"2024-05-02T10:11:12Z WARN botocore.credentials using temporary key {v} for role deploy\n",
        [v], ["botocore.credentials"])
    v = rand(ALNUM + "/+", 40)
    add("aws-secret-key", "ini",
        "[default]\nregion = eu-west-1\naws_secret_access_key = " + v + "\n", [v],
        ["aws_secret_access_key", "[default]"])
    v = rand(ALNUM + "/+", 40)
    add("aws-secret-key", "env", f"AWS_SECRET_ACCESS_KEY={v}\nAWS_REGION=us-east-1\n", [v],
        ["AWS_SECRET_ACCESS_KEY", "AWS_REGION=us-east-1"])
    v = rand(ALNUM + "/+", 40)
    add("aws-secret-key", "yaml", f"aws:\n  aws_secret_access_key: {v}\n", [v],
        ["aws_secret_access_key:"])

    v = "AIza" + rand(URLSAFE, 35)
    add("gcp-api-key", "json", '{"project": "atlas", "apiKey": "%s"}\n' % v, [v], ['"apiKey"'])
    v = "AIza" + rand(URLSAFE, 35)
    add("gcp-api-key", "code", f'genai.configure(api_key="{v}")\n', [v], ["genai.configure(api_key="])
    v = "GOCSPX-" + rand(URLSAFE, 28)
    add("gcp-oauth-secret", "json",
        '{"web": {"client_id": "123-abc.apps.googleusercontent.com", "client_secret": "%s"}}\n' % v,
        [v], ["client_id"])
    v = "GOCSPX-" + rand(URLSAFE, 28)
    add("gcp-oauth-secret", "prose", f"The OAuth client was recreated; its secret is {v} now.\n",
        [v], ["OAuth client"])

    v = rand(ALNUM, 3) + "8Q~" + rand(ALNUM + "_~.-", 34)
    add("azure-client-secret", "env", f"AZURE_CLIENT_ID=4f1c\nAZURE_CLIENT_SECRET={v}\n", [v],
        ["AZURE_CLIENT_SECRET"])
    v = rand(ALNUM, 3) + "7Q~" + rand(ALNUM + "_~-", 31)
    add("azure-client-secret", "log", f"msal: acquired token with client credential {v} (app reg)\n",
        [v], ["msal:"])
    v = rand(B64, 86) + "=="
    add("azure-storage-key", "connection",
        "DefaultEndpointsProtocol=https;AccountName=atlasdata;AccountKey=" + v
        + ";EndpointSuffix=core.windows.net\n", [v], ["AccountName=atlasdata", "AccountKey="])
    v = rand(B64, 43) + "="
    add("azure-storage-key", "code",
        'conn = "Endpoint=sb://atlas-bus.servicebus.windows.net/;SharedAccessKeyName='
        'RootManageSharedAccessKey;SharedAccessKey=' + v + '"\n', [v], ["SharedAccessKeyName"])
    v = rand(ALNUM, 30) + "%2B" + rand(ALNUM, 10) + "%3D"
    add("azure-sas", "url",
        "curl -o report.csv 'https://atlasdata.blob.core.windows.net/exports/report.csv?sv=2022-11-02"
        f"&ss=b&srt=o&sp=r&se=2025-01-01T00:00:00Z&spr=https&sig={v}'\n", [v],
        ["atlasdata.blob.core.windows.net", "sv=2022-11-02"])
    v = rand(ALNUM, 40) + "%3D"
    add("azure-sas", "log",
        f"INFO upload to https://atlas.blob.core.windows.net/c/x.bin?sv=2023-01-03&sp=cw&sig={v} ok\n",
        [v], ["INFO upload"])

    v = "dop_v1_" + rand(HEX, 64)
    add("digitalocean-token", "shell", f"doctl auth init --context prod -t {v}\n", [v], ["doctl"])
    v = "dop_v1_" + rand(HEX, 64)
    add("digitalocean-token", "hcl", f'provider "digitalocean" {{\n  token = "{v}"\n}}\n', [v],
        ['provider "digitalocean"'])
    v = "LTAI" + rand(ALNUM, 20)
    add("alibaba-access-key", "yaml", f"```yaml\noss:\n  access_key_id: {v}\n```\n", [v],
        ["access_key_id"])
    v = "LTAI" + rand(ALNUM, 16)
    add("alibaba-access-key", "prose", f"Aliyun key {v} was revoked after the audit.\n", [v])
    v = "HRKU-AA" + rand(URLSAFE, 58)
    add("heroku-api-key", "shell", f"export HEROKU_API_KEY={v}\n", [v], ["HEROKU_API_KEY"])
    v = "HRKU-AA" + rand(URLSAFE, 58)
    add("heroku-api-key", "http", f"Authorization: Bearer {v}\n", [v], ["Authorization: Bearer "])
    v = "dapi" + rand(HEX, 32)
    add("databricks-token", "env", f"DATABRICKS_HOST=https://adb-1.azuredatabricks.net\n"
        f"DATABRICKS_TOKEN={v}\n", [v], ["DATABRICKS_TOKEN="])
    v = "dapi" + rand(HEX, 32) + "-2"
    add("databricks-token", "json", '{"host": "adb-2", "token": "%s"}\n' % v, [v], ['"token"'])

    v = "ghp_" + rand(ALNUM, 36)
    add("github-token", "shell", f"export GITHUB_TOKEN={v}\ngh pr list\n", [v],
        ["export GITHUB_TOKEN=", "gh pr list"])
    v = "github_pat_" + rand(ALNUM + "_", 82)
    add("github-token", "json", '{"github": {"token": "%s"}}\n' % v, [v], ['"token"'])
    v = "ghs_" + rand(ALNUM, 36)
    add("github-token", "url", f"git remote set-url origin https://x-access-token:{v}@github.com/acme/atlas.git\n",
        [v], ["x-access-token", "github.com/acme/atlas.git"])
    v = "glpat-" + rand(URLSAFE, 20)
    add("gitlab-token", "http", f'curl --header "PRIVATE-TOKEN: {v}" https://gitlab.com/api/v4/projects\n',
        [v], ["PRIVATE-TOKEN"])
    v = "glrt-" + rand(URLSAFE, 24)
    add("gitlab-token", "yaml", f"```yaml\nrunners:\n  token: {v}\n```\n", [v], ["runners:"])
    v = "ATBB" + rand(ALNUM, 32)
    add("bitbucket-token", "env", f"BITBUCKET_APP_PASSWORD={v}\n", [v], ["BITBUCKET_APP_PASSWORD"])
    v = "ATBB" + rand(ALNUM, 36)
    add("bitbucket-token", "prose", f"Rotated the Bitbucket app password ({v}) on Monday.\n", [v])
    v = "ATATT3" + rand(URLSAFE, 186) + "=" + rand(HEX.upper(), 8)
    add("atlassian-token", "shell", f'curl -u ops@acme.io:{v} https://acme.atlassian.net/rest/api/3/myself\n',
        [v], ["acme.atlassian.net"])
    v = "ATATT3" + rand(URLSAFE, 190)
    add("atlassian-token", "yaml", f"```yaml\njira:\n  api_token: {v}\n```\n", [v], ["api_token:"])

    v = "npm_" + rand(ALNUM, 36)
    add("npm-token", "npmrc", f"//registry.npm.example/:_authToken={v}\n", [v], ["_authToken="])
    v = rand(HEX, 8) + "-" + rand(HEX, 4) + "-" + rand(HEX, 4) + "-" + rand(HEX, 4) + "-" + rand(HEX, 12)
    add("npm-token", "npmrc", f"registry=https://npm.acme.io/\n//npm.acme.io/:_authToken={v}\n", [v],
        ["registry=https://npm.acme.io/"])
    v = "pypi-AgEIcHlwaS5vcmc" + rand(URLSAFE, 60)
    add("pypi-token", "ini", f"[pypi]\nusername = __token__\npassword = {v}\n", [v],
        ["username = __token__"])
    v = "pypi-AgEIcHlwaS5vcmc" + rand(URLSAFE, 120)
    add("pypi-token", "shell", f"TWINE_PASSWORD={v} twine upload dist/*\n", [v], ["twine upload"])
    v = "dckr_pat_" + rand(URLSAFE, 27)
    add("docker-token", "shell", f"echo {v} | docker login -u acmebot --password-stdin\n", [v],
        ["docker login -u acmebot --password-stdin"])
    v = b64("acmebot:" + rand(ALNUM, 18))
    add("docker-token", "json", '{"auths": {"ghcr.io": {"auth": "%s"}}}\n' % v, [v], ['"auth"', "ghcr.io"])
    v = "AKCp" + rand(ALNUM, 69)
    add("artifactory-token", "env", f"ARTIFACTORY_API_KEY={v}\n", [v], ["ARTIFACTORY_API_KEY"])
    v = "cmVmd" + rand(ALNUM, 59)
    add("artifactory-token", "http", f"X-JFrog-Art-Api: {v}\n", [v], ["X-JFrog-Art-Api"])

    v = "squ_" + rand(HEX, 40)
    add("sonar-token", "shell", f"sonar-scanner -Dsonar.token={v}\n", [v], ["sonar-scanner"])
    v = "sqp_" + rand(HEX, 40)
    add("sonar-token", "yaml", f"```yaml\nenv:\n  SONAR_TOKEN: {v}\n```\n", [v], ["SONAR_TOKEN"])
    v = "hvs." + rand(URLSAFE, 90)
    add("vault-token", "http", f"X-Vault-Token: {v}\n", [v], ["X-Vault-Token"])
    v = "hvs." + rand(URLSAFE, 24)
    add("vault-token", "shell", f"export VAULT_TOKEN={v}\nvault kv get secret/app\n", [v], ["vault kv get"])
    v = rand(ALNUM, 14) + ".atlasv1." + rand(URLSAFE, 67)
    add("terraform-token", "json",
        '{"credentials": {"app.terraform.io": {"token": "%s"}}}\n' % v, [v], ["app.terraform.io"])
    v = rand(ALNUM, 14) + ".atlasv1." + rand(URLSAFE, 70)
    add("terraform-token", "env", f"TF_TOKEN_app_terraform_io={v}\n", [v], ["TF_TOKEN_app_terraform_io"])
    v = "dp.st.prd." + rand(ALNUM, 40)
    v = "dp.st." + rand(ALNUM, 43)
    add("doppler-token", "shell", f"doppler run --token {v} -- ./start.sh\n", [v], ["./start.sh"])
    v = "dp.pt." + rand(ALNUM, 43)
    add("doppler-token", "env", f"DOPPLER_TOKEN={v}\n", [v], ["DOPPLER_TOKEN"])
    v = "pul-" + rand(HEX, 40)
    add("pulumi-token", "env", f"PULUMI_ACCESS_TOKEN={v}\n", [v], ["PULUMI_ACCESS_TOKEN"])
    v = "pul-" + rand(HEX, 40)
    add("pulumi-token", "log", f"[ci] pulumi login using {v} ... done\n", [v], ["pulumi login"])
    v = "PMAK-" + rand(HEX, 24) + "-" + rand(HEX, 34)
    add("postman-key", "http", f"X-Api-Key: {v}\n", [v], ["X-Api-Key"])
    v = "PMAK-" + rand(HEX, 24) + "-" + rand(HEX, 34)
    add("postman-key", "code", f'const POSTMAN = "{v}";\n', [v], ["const POSTMAN"])
    v = "glc_" + rand(ALNUM + "+/", 60) + "=="
    add("grafana-token", "yaml", f"```yaml\ngrafana:\n  cloud_token: {v}\n```\n", [v], ["cloud_token"])
    v = "glsa_" + rand(ALNUM, 32) + "_" + rand(HEX, 8)
    add("grafana-token", "http", f"Authorization: Bearer {v}\n", [v], ["Bearer"])
    v = "sntrys_" + rand(ALNUM + "+/=", 60) + "_" + rand(ALNUM, 40)
    add("sentry-token", "env", f"SENTRY_AUTH_TOKEN={v}\n", [v], ["SENTRY_AUTH_TOKEN"])
    v = "sntryu_" + rand(HEX, 64)
    add("sentry-token", "shell", f"sentry-cli --auth-token {v} releases new 1.4.0\n", [v], ["releases new"])
    v = "NRAK-" + rand(UPPER + DIGITS, 27)
    add("newrelic-key", "http", f"Api-Key: {v}\n", [v], ["Api-Key"])
    v = "NRAK-" + rand(UPPER + DIGITS, 27)
    add("newrelic-key", "yaml", f"```yaml\nnewrelic:\n  user_key: {v}\n```\n", [v], ["user_key"])
    v = "dt0c01." + rand(UPPER + DIGITS, 24) + "." + rand(UPPER + DIGITS, 64)
    add("dynatrace-token", "http", f"Authorization: Api-Token {v}\n", [v], ["Api-Token"])
    v = "dt0c01." + rand(UPPER + DIGITS, 24) + "." + rand(UPPER + DIGITS, 64)
    add("dynatrace-token", "env", f"DT_API_TOKEN={v}\n", [v], ["DT_API_TOKEN"])
    v = "lin_api_" + rand(ALNUM, 40)
    add("linear-key", "code", f'client = LinearClient(api_key="{v}")\n', [v], ["LinearClient"])
    v = "lin_api_" + rand(ALNUM, 40)
    add("linear-key", "prose", f"Linear key {v} belongs to the triage bot.\n", [v], ["triage bot"])
    v = "secret_" + rand(ALNUM, 43)
    add("notion-token", "env", f"NOTION_TOKEN={v}\n", [v], ["NOTION_TOKEN"])
    v = "ntn_" + rand(DIGITS, 11) + rand(ALNUM, 35)
    add("notion-token", "code", f'notion = Client(auth="{v}")\n', [v], ["notion = Client(auth="])

    v = "xoxb-" + rand(DIGITS, 12) + "-" + rand(DIGITS, 13) + "-" + rand(ALNUM, 24)
    add("slack-token", "env", f"SLACK_BOT_TOKEN={v}\n", [v], ["SLACK_BOT_TOKEN"])
    v = "xoxp-" + rand(DIGITS, 11) + "-" + rand(DIGITS, 12) + "-" + rand(HEX, 32)
    add("slack-token", "http", f"Authorization: Bearer {v}\n", [v], ["Authorization: Bearer "])
    v = ("https://hooks.slack.com/services/T" + rand(UPPER + DIGITS, 8) + "/B" + rand(UPPER + DIGITS, 10)
         + "/" + rand(ALNUM, 24))
    add("slack-webhook", "shell", f"curl -X POST -d @msg.json {v}\n", [v], ["curl -X POST -d @msg.json "])
    v = "https://hooks.slack.com/workflows/T" + rand(UPPER + DIGITS, 8) + "/A" + rand(UPPER + DIGITS, 10) \
        + "/" + rand(DIGITS, 18) + "/" + rand(ALNUM, 24)
    add("slack-webhook", "yaml", f"```yaml\nalerts:\n  webhook: {v}\n```\n", [v], ["webhook:"])
    v = "M" + rand(URLSAFE, 25) + "." + rand(URLSAFE, 6) + "." + rand(URLSAFE, 38)
    add("discord-token", "env", f"DISCORD_BOT={v}\n", [v], ["DISCORD_BOT"])
    v = "N" + rand(URLSAFE, 23) + "." + rand(URLSAFE, 6) + "." + rand(URLSAFE, 27)
    add("discord-token", "code", f"bot.run('{v}')\n", [v], ["bot.run("])
    v = rand(URLSAFE, 68)
    add("discord-webhook", "url", f"Post release notes to https://discord.com/api/webhooks/1187765432109876543/{v}\n",
        [v], ["https://discord.com/api/webhooks/1187765432109876543/"])
    v = rand(URLSAFE, 68)
    add("discord-webhook", "json", '{"webhook": "https://canary.discordapp.com/api/webhooks/998877665544332211/%s"}\n' % v,
        [v], ["998877665544332211"])
    v = rand(DIGITS, 10) + ":AA" + rand(URLSAFE, 33)
    add("telegram-token", "code", f'bot = telebot.TeleBot("{v}")\n', [v], ["telebot.TeleBot"])
    v = "7" + rand(DIGITS, 8) + ":AA" + rand(URLSAFE, 33)
    add("telegram-token", "url", f"GET https://api.telegram.org/bot{v}/getUpdates\n", [v], ["getUpdates"])
    v = "SK" + rand(HEX, 32)
    add("twilio-key", "env", f"TWILIO_API_KEY={v}\nTWILIO_ACCOUNT_SID=AC{rand(HEX, 32)}\n", [v],
        ["TWILIO_ACCOUNT_SID="])
    v = "SK" + rand(HEX, 32)
    add("twilio-key", "code", f'client = Client("{v}", api_secret, account_sid)\n', [v], ["api_secret"])
    v = rand(HEX, 32)
    add("env-secret", "env", f"TWILIO_AUTH_TOKEN={v}\n", [v], ["TWILIO_AUTH_TOKEN="])
    # issue 30: the auth token has no prefix; beside the account SID or the word twilio it is one
    sid, v = "AC" + rand(HEX, 32), rand(HEX, 32)
    add("twilio-token", "code", f'client = Client("{sid}", "{v}")\n', [v], [sid])
    v = rand(HEX, 32)
    add("twilio-token", "prose", f"The Twilio auth token {v} was rotated.\n", [v], ["rotated"])
    v = "SG." + rand(URLSAFE, 22) + "." + rand(URLSAFE, 43)
    add("sendgrid-key", "env", f"SENDGRID_API_KEY={v}\n", [v], ["SENDGRID_API_KEY"])
    v = "SG." + rand(URLSAFE, 22) + "." + rand(URLSAFE, 43)
    add("sendgrid-key", "http", f"Authorization: Bearer {v}\n", [v], ["Bearer"])
    v = "key-" + rand(HEX, 32)
    add("mailgun-key", "shell", f"curl -s --user 'api:{v}' https://api.mailgun.net/v3/acme.io/messages\n",
        [v], ["api.mailgun.net"])
    v = "key-" + rand(HEX, 32)
    add("mailgun-key", "yaml", f"```yaml\nmailgun:\n  api_key: {v}\n```\n", [v], ["api_key:"])
    v = rand(HEX, 32) + "-us14"
    add("mailchimp-key", "env", f"MAILCHIMP_KEY={v}\n", [v], ["MAILCHIMP_KEY"])
    v = rand(HEX, 32) + "-us6"
    add("mailchimp-key", "prose", f"The newsletter job uses {v} for the list sync.\n", [v])

    v = "sk_live_" + rand(ALNUM, 24)
    add("stripe-key", "env", f"STRIPE_SECRET_KEY={v}\nSTRIPE_PUBLISHABLE_KEY=pk_live_{rand(ALNUM, 24)}\n",
        [v], ["STRIPE_PUBLISHABLE_KEY=pk_live_"])
    v = "rk_test_" + rand(ALNUM, 30)
    add("stripe-key", "code", f"stripe.api_key = '{v}'\n", [v], ["stripe.api_key"])
    v = "whsec_" + rand(ALNUM, 32)
    add("stripe-key", "log", f"webhook: verifying signature with secret {v}\n", [v], ["webhook:"])
    v = "sq0atp-" + rand(URLSAFE, 22)
    add("square-token", "env", f"SQUARE_ACCESS_TOKEN={v}\n", [v], ["SQUARE_ACCESS_TOKEN"])
    v = "EAAA" + rand(URLSAFE, 60)
    add("square-token", "http", f"Authorization: Bearer {v}\n", [v], ["Bearer"])
    v = "shpat_" + rand(HEX, 32)
    add("shopify-token", "http", f"X-Shopify-Access-Token: {v}\n", [v], ["X-Shopify-Access-Token"])
    v = "shpss_" + rand(HEX, 32)
    add("shopify-token", "toml", f'```toml\n[shopify]\nshared_secret = "{v}"\n```\n', [v], ["shared_secret"])
    v = "access_token$production$" + rand(LOWER + DIGITS, 16) + "$" + rand(HEX, 32)
    add("braintree-token", "code", f'gateway = braintree.BraintreeGateway(access_token="{v}")\n', [v],
        ["BraintreeGateway"])
    v = "access_token$production$" + rand(LOWER + DIGITS, 16) + "$" + rand(HEX, 32)
    add("braintree-token", "prose", f"PayPal handed over {v} for the marketplace.\n", [v])

    v = "sk-proj-" + rand(URLSAFE, 120)
    add("openai-key", "env", f"OPENAI_API_KEY={v}\n", [v], ["OPENAI_API_KEY="])
    v = "sk-" + rand(ALNUM, 20) + "T3BlbkFJ" + rand(ALNUM, 20)
    add("openai-key", "code", f'openai.api_key = "{v}"\n', [v], ["openai.api_key"])
    v = "sk-ant-api03-" + rand(URLSAFE, 93) + "AA"
    add("anthropic-key", "shell", f"export ANTHROPIC_API_KEY={v}\nclaude --version\n", [v], ["claude --version"])
    v = "sk-ant-admin01-" + rand(URLSAFE, 93) + "AA"
    add("anthropic-key", "http", f"x-api-key: {v}\nanthropic-version: 2023-06-01\n", [v],
        ["anthropic-version: 2023-06-01", "x-api-key: "])
    v = "hf_" + rand(ALNUM, 34)
    add("huggingface-token", "shell", f"huggingface-cli login --token {v}\n", [v], ["huggingface-cli login"])
    v = "hf_" + rand(ALNUM, 34)
    add("huggingface-token", "code", f'login(token="{v}")\n', [v], ["login(token="])
    v = "gsk_" + rand(ALNUM, 52)
    add("ai-api-key", "env", f"GROQ_API_KEY={v}\n", [v], ["GROQ_API_KEY"])
    v = "pplx-" + rand(ALNUM, 48)
    add("ai-api-key", "http", f"Authorization: Bearer {v}\n", [v], ["Bearer"])
    v = "r8_" + rand(ALNUM, 37)
    add("ai-api-key", "shell", f"export REPLICATE_API_TOKEN={v}\n", [v], ["REPLICATE_API_TOKEN"])
    v = "xai-" + rand(ALNUM, 80)
    add("ai-api-key", "json", '{"provider": "xai", "key": "%s"}\n' % v, [v], ['"provider"'])

    jwt = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9." + "eyJ" + rand(URLSAFE, 60) + "." + rand(URLSAFE, 43))
    add("jwt", "http", f"Authorization: Bearer {jwt}\n", [jwt], ["Authorization: Bearer "])
    jwt = "eyJhbGciOiJub25lIn0." + "eyJ" + rand(URLSAFE, 40) + "."
    add("jwt", "log", f"2024-05-02 12:00:01 DEBUG auth: decoded id_token={jwt} for alice\n", [jwt[:-1]],
        ["DEBUG auth:", "for alice"])
    jwt = "eyJhbGciOiJSUzI1NiJ9." + "eyJ" + rand(URLSAFE, 80) + "." + rand(URLSAFE, 86)
    add("jwt", "cookie", f"Cookie: theme=dark; jwt={jwt}\n", [jwt], ["theme=dark", "jwt="])

    v = "AGE-SECRET-KEY-1" + rand("QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 58)
    add("age-key", "file", f"# created: 2024-05-01T10:00:00Z\n# public key: age1{rand(LOWER + DIGITS, 58)}\n{v}\n",
        [v], ["# public key: age1"])
    v = "AGE-SECRET-KEY-1" + rand("QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 58)
    add("age-key", "env", f"SOPS_AGE_KEY={v}\n", [v], ["SOPS_AGE_KEY"])

    v = rand(ALNUM, 40)
    add("bearer", "http", f"GET /v1/orders HTTP/1.1\nHost: api.acme.io\nAuthorization: Bearer {v}\n", [v],
        ["Authorization: Bearer ", "Host: api.acme.io"])
    v = rand(ALNUM + "._-", 32)
    add("bearer", "shell", f'curl -H "Authorization: Bearer {v}" https://api.acme.io/v1/me\n', [v],
        ["Authorization: Bearer "])
    v = rand(ALNUM, 24) + "." + rand(ALNUM, 20)
    add("bearer", "code", f'headers = {{"Authorization": "Bearer {v}"}}\n', [v], ['"Authorization": "Bearer '])
    v = b64("deploy:" + rand(ALNUM, 16))
    add("basic-auth", "http", f"Authorization: Basic {v}\n", [v], ["Authorization: Basic "])
    v = b64("grafana:" + rand(ALNUM + "!#", 14))
    add("basic-auth", "log", f"proxy: forwarding header 'Authorization: Basic {v}' upstream\n", [v], ["upstream"])
    v = rand(HEX, 32)
    add("api-key-header", "http", f"X-API-Key: {v}\nAccept: application/json\n", [v], ["X-API-Key: "])
    v = rand(ALNUM, 28)
    add("api-key-header", "shell", f"curl -H 'X-Auth-Token: {v}' https://api.acme.io/v2/servers\n", [v],
        ["X-Auth-Token: "])
    v = rand(ALNUM, 30)
    add("api-key-header", "json", '{"headers": {"X-Access-Token": "%s"}}\n' % v, [v], ['"X-Access-Token"'])
    v = rand(LOWER + DIGITS, 32)
    add("session-cookie", "http", f"Cookie: sessionid={v}; csrftoken=abc; theme=dark\n", [v],
        ["Cookie: sessionid=", "theme=dark"])
    v = "s%3A" + rand(URLSAFE, 32) + "." + rand(ALNUM + "%", 43)
    add("session-cookie", "http", f"Set-Cookie: connect.sid={v}; Path=/; HttpOnly\n", [v],
        ["Set-Cookie: connect.sid=", "Path=/; HttpOnly"])
    v = rand(ALNUM, 40)
    add("session-cookie", "log", f"< set-cookie: _gitlab_session={v}; path=/; secure\n", [v], ["_gitlab_session="])

    v = rand(ALNUM, 16)
    add("connection-string", "env", f"DATABASE_URL=postgres://app:{v}@db.internal:5432/atlas\n", [v],
        ["DATABASE_URL=postgres://app:", "@db.internal:5432/atlas"])
    v = rand(ALNUM, 20)
    add("connection-string", "code", f'client = MongoClient("mongodb+srv://reporter:{v}@cluster0.ab1cd.mongodb.net/?retryWrites=true")\n',
        [v], ["mongodb+srv://reporter:", "cluster0.ab1cd.mongodb.net"])
    v = rand(ALNUM + "!", 14)
    add("connection-string", "config",
        f'"ConnectionStrings": {{"Main": "Server=tcp:sql1.acme.io,1433;Database=atlas;User Id=svc_atlas;Password={v};Encrypt=True"}}\n',
        [v], ["User Id=svc_atlas", "Encrypt=True"])
    v = rand(ALNUM, 18)
    add("connection-string", "libpq", f"psql 'host=db.internal port=5432 dbname=atlas user=atlas password={v}'\n",
        [v], ["dbname=atlas"])
    v = rand(ALNUM, 18)
    add("connection-string", "jdbc", f"spring.datasource.url=jdbc:mysql://db:3306/atlas?user=atlas&password={v}&useSSL=true\n",
        [v], ["useSSL=true", "user=atlas"])
    v = rand(ALNUM, 24)
    add("connection-string", "log", f"celery: connecting to redis://:{v}@cache.internal:6379/0\n", [v],
        ["cache.internal:6379/0"])
    v = rand(ALNUM, 12) + "!"
    add("cli-password", "shell", f"mysqldump -h db.internal -u root -p{v} atlas > dump.sql\n", [v],
        ["mysqldump -h db.internal -u root -p", "atlas > dump.sql"])
    v = rand(ALNUM, 14)
    add("cli-password", "shell", f"sshpass -p '{v}' ssh deploy@web1.acme.io uptime\n", [v],
        ["deploy@web1.acme.io"])
    v = rand(ALNUM, 16)
    add("cli-password", "shell", f"pg_restore --password={v} --dbname=atlas backup.dump\n", [v], ["--dbname=atlas"])
    v = rand(ALNUM, 24)
    add("cli-password", "log", f"[job 41] running: deployctl push --api-key {v} --env prod\n", [v], ["--env prod"])
    v = b64(rand(ALNUM, 20))
    w = b64("postgres://app:" + rand(ALNUM, 12) + "@db/atlas")
    add("k8s-secret", "yaml",
        f"apiVersion: v1\nkind: Secret\nmetadata:\n  name: atlas-db\ntype: Opaque\ndata:\n  password: {v}\n"
        f"  url: {w}\n", [v, w], ["name: atlas-db", "kind: Secret", "  password: ", "  url: "])
    v = rand(ALNUM, 20)
    add("k8s-secret", "yaml",
        f"```yaml\napiVersion: v1\nkind: Secret\nmetadata:\n  name: api\nstringData:\n  API_KEY: \"{v}\"\n  "
        f"config.json: |\n    {{\"token\": \"{v[:10]}zz{v[10:]}\"}}\n```\n", [v, v[:10] + "zz" + v[10:]],
        ["stringData:", "config.json: |"])

    v = rand(ALNUM, 14)
    add("env-secret", "env", f"DB_HOST=db.internal\nDB_PASSWORD={v}\n", [v], ["DB_HOST=db.internal", "DB_PASSWORD="])
    v = rand(ALNUM + "!@#", 16)
    add("env-secret", "yaml", f"```yaml\ndatabase:\n  user: atlas\n  password: {v}\n```\n", [v], ["user: atlas"])
    v = rand(ALNUM, 30)
    add("env-secret", "json", '{"client_id": "atlas-web", "client_secret": "%s"}\n' % v, [v],
        ['"client_secret": "'])
    v = rand(ALNUM, 20)
    add("env-secret", "code", f'SECRET_KEY = "{v}"\n', [v], ["SECRET_KEY = "])
    v = rand(ALNUM, 12)
    add("env-secret", "log", f"2024-05-02 09:12:44 ERROR login failed user=alice password={v} ip=10.0.0.7\n",
        [v], ["user=alice", "ip=10.0.0.7"])
    v = rand(ALNUM, 24)
    add("env-secret", "toml", f'```toml\n[smtp]\nhost = "smtp.acme.io"\nsmtp_password = "{v}"\n```\n', [v],
        ['host = "smtp.acme.io"'])
    v = rand(ALNUM, 18)
    add("env-secret", "code", f'const cfg = {{ apiKey: "{v}", region: "eu" }};\n', [v], ['region: "eu"'])
    v = rand(ALNUM, 22)
    add("env-secret", "prose", f"The signing secret for staging is signing_key={v} until rotation.\n", [v],
        ["until rotation"])
    v = rand(ALNUM, 16)
    add("env-secret", "log", '2024-05-02 INFO POST /login body="{\\"user\\":\\"bob\\",\\"password\\":\\"%s\\"}"\n' % v,
        [v], ['\\"user\\":\\"bob\\"'])
    v = rand(ALNUM, 24)
    add("env-secret", "yaml", f"```yaml\nenv:\n  - name: API_TOKEN\n    value: {v}\n```\n", [v], ["name: API_TOKEN"])
    v = rand(ALNUM, 12)
    add("env-secret", "code", f"define('DB_PASSWORD', '{v}');\n", [v], ["define('DB_PASSWORD', "])
    v = rand(ALNUM, 12)
    add("env-secret", "xml", f"<server>\n  <id>nexus</id>\n  <password>{v}</password>\n</server>\n", [v],
        ["<password>", "</password>"])
    v = rand(ALNUM, 30)
    add("env-secret", "netrc", f"machine api.heroku.com\n  login ops@acme.io\n  password {v}\n", [v],
        ["login ops@acme.io"])
    v = rand(ALNUM + "/+", 40)
    add("aws-secret-key", "shell", f"aws configure set aws_secret_access_key {v}\n", [v],
        ["aws configure set aws_secret_access_key "])
    v = "da2-" + rand(LOWER + DIGITS, 26)
    add("aws-api-key", "json", '{"aws_appsync_apiKey": "%s"}\n' % v, [v], ["aws_appsync_apiKey"])
    v = "ABSK" + rand(B64, 128)
    add("aws-api-key", "prose", f"Bedrock key {v} was revoked.\n", [v], ["Bedrock key"])
    v = "sgp_" + rand(HEX, 16) + "_" + rand(HEX, 40)
    add("sourcegraph-token", "shell", f"export SRC_ACCESS_TOKEN={v}\n", [v], ["SRC_ACCESS_TOKEN"])
    v = "sgp_" + rand(HEX, 40)
    add("sourcegraph-token", "http", f"src search -token {v} 'repo:x'\n", [v], ["src search"])
    v = "A3-" + "-".join(rand(UPPER + DIGITS, n) for n in (6, 11, 5, 5, 5))
    add("onepassword-key", "prose", f"The emergency kit lists {v} as the secret key.\n", [v])
    v = "A3-" + "-".join(rand(UPPER + DIGITS, n) for n in (6, 6, 5, 5, 5, 5))
    add("onepassword-key", "yaml", f"```yaml\nop:\n  key: {v}\n```\n", [v], ["op:"])
    v = "fm2_" + rand(B64, 140)
    add("flyio-token", "shell", f"flyctl deploy --access-token {v}\n", [v], ["flyctl deploy"])
    v = "fo1_" + rand(URLSAFE, 43)
    add("flyio-token", "env", f"FLY_API_TOKEN={v}\n", [v], ["FLY_API_TOKEN="])
    v = "pscale_tkn_" + rand(ALNUM, 43)
    add("saas-token", "env", f"PLANETSCALE_TOKEN={v}\n", [v], ["PLANETSCALE_TOKEN="])
    v = "rubygems_" + rand(HEX, 48)
    add("saas-token", "prose", f"gem push used {v} from ~/.gem/credentials.\n", [v], ["gem push"])
    v = "EAAC" + rand(ALNUM, 150)
    add("facebook-token", "url", f"GET https://graph.facebook.com/me?access_token={v}\n", [v],
        ["graph.facebook.com"])
    v = rand(ALNUM, 52) + "JQQJ99" + rand(ALNUM, 1) + "B" + rand(ALNUM, 16) + "a" + rand(ALNUM, 7)
    add("azure-key", "env", f"AZURE_OPENAI_API_KEY={v}\n", [v], ["AZURE_OPENAI_API_KEY="])
    v = rand(ALNUM, 52) + "JQQJ9D" + rand(ALNUM, 1) + "C" + rand(ALNUM, 16) + "Q" + rand(ALNUM, 7) + "AA=="
    add("azure-key", "prose", f"The Speech resource key {v} was rotated.\n", [v], ["was rotated"])
    v = "EAAM" + rand(ALNUM, 120)
    add("facebook-token", "log", f"page token {v} expired\n", [v], ["expired"])
    return s


CORPUS = _corpus()


def _private_key_samples():
    body = [rand(B64, 64) for _ in range(6)] + [rand(B64, 20) + "=="]
    pem = "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(body) + "\n-----END RSA PRIVATE KEY-----\n"
    samples = [("fenced", "Key used by the deploy box:\n```\n" + pem + "```\n", body)]
    ssh = [rand(B64, 70) for _ in range(4)]
    samples.append(("indented", "id_ed25519:\n    -----BEGIN OPENSSH PRIVATE KEY-----\n"
                    + "".join("    " + b + "\n" for b in ssh)
                    + "    -----END OPENSSH PRIVATE KEY-----\n", ssh))
    quoted = [rand(B64, 64) for _ in range(3)]
    samples.append(("quoted", "> -----BEGIN EC PRIVATE KEY-----\n" + "".join("> " + b + "\n" for b in quoted)
                    + "> -----END EC PRIVATE KEY-----\n", quoted))
    js = [rand(B64, 64) for _ in range(3)]
    samples.append(("json", '{"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY-----\\n'
                    + "\\n".join(js) + '\\n-----END PRIVATE KEY-----\\n", "client_email": "svc@proj.iam"}\n', js))
    cut = [rand(B64, 64) for _ in range(3)]
    samples.append(("unterminated", "Pasted by mistake:\n-----BEGIN PRIVATE KEY-----\n" + "\n".join(cut)
                    + "\nand the rest was cut off.\n", cut))
    enc = [rand(B64, 64) for _ in range(3)]
    samples.append(("encrypted", "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"
                    "DEK-Info: AES-256-CBC," + rand(HEX.upper(), 32) + "\n\n" + "\n".join(enc)
                    + "\n-----END RSA PRIVATE KEY-----\n", enc))
    pgp = [rand(B64, 64) for _ in range(3)]
    samples.append(("pgp", "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n" + "\n".join(pgp) + "\n=" + rand(B64, 4)
                    + "\n-----END PGP PRIVATE KEY BLOCK-----\n", pgp))
    return samples


PRIVATE_KEYS = _private_key_samples()


# ------------------------------------------------------------------------------------------
# Every kind, in context
# ------------------------------------------------------------------------------------------

def test_corpus_covers_every_kind_twice():
    seen = {}
    for kind, _ctx, _text, _secrets, _keep in CORPUS:
        seen[kind] = seen.get(kind, 0) + 1
    seen["private-key"] = len(PRIVATE_KEYS)
    missing = [k for k in memshelf.REDACTION_KINDS if seen.get(k, 0) < 2]
    assert missing == []
    assert set(seen) <= set(memshelf.REDACTION_KINDS)
    assert len(set(memshelf.REDACTION_KINDS)) == len(memshelf.REDACTION_KINDS)


@pytest.mark.parametrize("kind,ctx,text,secrets,keep", CORPUS,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CORPUS)])
def test_secret_masked_with_its_kind(kind, ctx, text, secrets, keep):
    out, report = redact(text)
    for secret in secrets:
        assert secret not in out
    assert f"«redacted:{kind}»" in out
    assert report["counts"].get(kind, 0) >= 1
    for word in keep:
        assert word in out
    # find_secrets sees the same spans, without rewriting
    found = find_secrets(text)
    assert kind in {f["kind"] for f in found}
    for f in found:
        assert text[f["start"]:f["end"]] and f["line"] >= 1


def test_recall_over_the_corpus():
    caught = sum(all(s not in redact(t)[0] for s in secrets) for _k, _c, t, secrets, _w in CORPUS)
    assert caught / len(CORPUS) >= 0.95


@pytest.mark.parametrize("name,text,body", PRIVATE_KEYS, ids=[p[0] for p in PRIVATE_KEYS])
def test_private_key_body_masked_armor_kept(name, text, body):
    out, report = redact(text)
    assert report["counts"] == {"private-key": 1}
    for line in body:
        assert line not in out
    for armor in re.findall(r"-----(?:BEGIN|END) [A-Z ]+-----", text):
        assert armor in out
    assert out.count("«redacted:private-key»") == 1
    if name == "unterminated":
        assert "and the rest was cut off." in out
    if name == "json":
        assert '"client_email": "svc@proj.iam"' in out
        assert "-----BEGIN PRIVATE KEY-----\\n«redacted:private-key»\\n-----END" in out
    if name == "quoted":
        assert "> -----END EC PRIVATE KEY-----" in out


def test_token_inside_a_key_body_does_not_split_the_block():
    body = ["MIIEow" + rand(B64, 58), "AKIA" + rand(UPPER + DIGITS, 16) + "/" + rand(B64, 43), rand(B64, 64)]
    text = "-----BEGIN PRIVATE KEY-----\n" + "\n".join(body) + "\n-----END PRIVATE KEY-----\n"
    out, report = redact(text)
    assert report["counts"] == {"private-key": 1}
    assert out == "-----BEGIN PRIVATE KEY-----\n«redacted:private-key»\n-----END PRIVATE KEY-----\n"


def test_idempotent_over_the_whole_corpus():
    texts = [t for _k, _c, t, _s, _w in CORPUS] + [t for _n, t, _b in PRIVATE_KEYS]
    texts.append("".join(texts))
    for text in texts + BENIGN:
        once, _ = redact(text)
        twice, report = redact(once)
        assert twice == once
        assert report["total"] == 0
        assert find_secrets(once) == []
        once_legacy, _ = redact(text, legacy_compat=True)
        twice_legacy, report = redact(once_legacy, legacy_compat=True)
        assert twice_legacy == once_legacy and report["total"] == 0


def test_masks_never_match():
    text = ("TOKEN=«redacted:env-secret»\nAuthorization: Bearer «redacted:bearer»\n"
            '{"password": "«redacted:env-secret»"}\npostgres://app:«redacted:connection-string»@db/x\n'
            "«redacted:github-token» and «redacted:private-key»\n")
    assert redact(text) == (text, {"total": 0, "counts": {}, "summary": "no secrets found", "hits": []})
    assert find_secrets(text, legacy_compat=True) == []


# ------------------------------------------------------------------------------------------
# Not secrets (docs/redaction.md § What counts as a placeholder)
# ------------------------------------------------------------------------------------------

BENIGN = [
    "API_KEY=<your key>\n",
    "export OPENAI_API_KEY=${OPENAI_API_KEY}\n",
    "DB_PASSWORD=changeme\n",
    "password: ****\n",
    '{"password": "********", "token": "<token>"}\n',
    "MAX_TOKENS=4096\nTOKEN_TTL=3600\nmax_tokens: 8192\n",
    "commit 3f9c2a7d1e4b5c6a7f8e9d0c1b2a3f4e5d6c7b8a\n",
    "git checkout 9fceb02d0ae598e95dc970b74767f19372d61af8\n",
    "request id 123e4567-e89b-12d3-a456-426614174000 failed\n",
    "sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGd0c9Dk2mGzZ3X9w1nV0y7QyJ3q3wY1f4zq0hQ3l2cE deploy@ci\n",
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7vbqajDhA0Yb8V6Y3mMfH5x2xqE8Wqf9Gz8p4c1Ff9nV2jJ1 ops@bastion\n",
    "-----BEGIN CERTIFICATE-----\nMIIDdzCCAl+gAwIBAgIEAgAAuTANBgkqhkiG9w0BAQUFADBaMQswCQYDVQQGEwJJ\n"
    "RTESMBAGA1UEChMJQmFsdGltb3JlMRMwEQYDVQQLEwpDeWJlclRydXN0MSIwIAYD\n-----END CERTIFICATE-----\n",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEx3b9fYQp2rW6TgDk0Rw1kJ8aLm7N\n"
    "-----END PUBLIC KEY-----\n",
    "STRIPE_PUBLISHABLE_KEY=pk_live_51HxQa2LkdIwHu7ixQx8wq3yGf2Ztk0aZ\n",
    "Test card 4242 4242 4242 4242, exp 12/34.\n",
    "Password: reset flow decided; the token: rotated weekly.\n",
    "We chose JWT bearer tokens with a shared secret stored in the vault.\n",
    'api_key = os.environ["OPENAI_API_KEY"]\n',
    "const token = process.env.GITHUB_TOKEN;\n",
    "password = getpass()\nsecret = settings.SECRET_KEY\n",
    "token = request.headers.get('Authorization')\n",
    "def login(user, password=None, token: str = None):\n",
    "client = Client(api_key=api_key, password=password)\n",
    "GITHUB_TOKEN=${{ secrets.GITHUB_TOKEN }}\n",
    "  token: ${{ secrets.NPM_TOKEN }}\n",
    "PASSWORD_MIN_LENGTH=12\nPASSWORD_FILE=/run/secrets/db\nSECRET_NAME=atlas-db\n",
    "token_url = \"https://oauth2.googleapis.com/token\"\n",
    "tokenizer = \"cl100k_base\"\n",
    "ghp_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx is the documented shape.\n",
    "Use AKIAIOSFODNN7EXAMPLE in docs only.\n",
    "Sentry DSN https://3f1c2b4a5d6e7f8091a2b3c4d5e6f708@o123456.ingest.sentry.io/4504\n",
    "Twilio SID AC0123456789abcdef0123456789abcdef\n",
    '<script src="app.js" integrity="sha384-oqVuAfXRKap7fdgcCY5uykM6+R9GqQ8K/uxy9rx7HNQlGYl1kPzQho1wx4JwY8wC"></script>\n',
    "![logo](data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==)\n",
    "Authorization: Bearer <token>\nAuthorization: Bearer $TOKEN\nAuthorization: Bearer {{api_token}}\n",
    "curl -u $USER:$PASS https://api.acme.io\n",
    "postgres://app:${DB_PASSWORD}@db:5432/atlas\nmysql://root:password@localhost/test\n",
    "redis://user:secret@example.com:6379\n",
    "docker login -u bot --password-stdin < token.txt\n",
    "Run mysql -u root -p and type it at the prompt.\n",
    "enabled: true\npassword_required: false\ntoken: null\nsecret: ''\n",
    "The api-key header is required; use --password to be prompted.\n",
    "if token == expected:\n    return True\n",
    "Set-Cookie: theme=dark; Path=/\nCookie: lang=en; tz=UTC\n",
    "https://github.com/acme/atlas/blob/9fceb02d0ae598e95dc970b74767f19372d61af8/README.md\n",
    "The access key id rotation runs nightly; see TOKEN-1234.\n",
    "host = db.internal\nport = 5432\nuser = atlas\n",
    "Set OPENAI_API_KEY=sk-... before running.\n",
    "API_KEY=xxxxxxxxxxxxxxxxxxxxxxxx\nSECRET=••••••••\nTOKEN=...\n",
    "PASSWORD=%DB_PASSWORD%\nTOKEN={{ vault_token }}\nKEY_FILE=[path]\n",
    "kind: ConfigMap\ndata:\n  LOG_LEVEL: debug\n",
]


def test_benign_text_changes_no_line():
    changed = []
    for text in BENIGN:
        out, report = redact(text)
        for before, after in zip(text.split("\n"), out.split("\n")):
            if before != after:
                changed.append((before, after))
        assert report["total"] == 0 or changed
    assert changed == []


def test_hashes_uuids_and_public_material_survive_in_bulk():
    lines = []
    for _ in range(200):
        lines.append("commit " + rand(HEX, 40))
        lines.append("sha256:" + rand(HEX, 64))
        lines.append("id " + "-".join(rand(HEX, n) for n in (8, 4, 4, 4, 12)))
        lines.append("publishable pk_live_" + rand(ALNUM, 24))
    text = "\n".join(lines) + "\n"
    out, report = redact(text)
    assert report["total"] == 0
    assert out == text


def test_example_host_and_placeholders_in_urls():
    assert redact("https://admin:hunter22@example.org/path")[1]["total"] == 0
    assert redact("https://admin:hunter22@api.example.net")[1]["total"] == 0
    assert redact("https://admin:hunter22@acme.io/path")[0] == \
        "https://admin:«redacted:connection-string»@acme.io/path"


def test_digits_only_rule_depends_on_the_key():
    assert redact("API_TOKEN=123456\n")[1]["total"] == 0
    assert redact("DB_PASSWORD=482913\n")[0] == "DB_PASSWORD=«redacted:env-secret»\n"
    assert redact("TOKEN=8273645190283\n")[0] == "TOKEN=«redacted:env-secret»\n"
    # sequential digits are a placeholder (issue 19)
    assert redact("DB_PASSWORD=123456\nTOKEN=1234567890123\n")[1]["total"] == 0


# ------------------------------------------------------------------------------------------
# The assignment rule and the quote rule (docs/redaction.md § The contract)
# ------------------------------------------------------------------------------------------

def test_equals_quote_rule():
    key = "sk-proj-" + rand(URLSAFE, 40)
    assert redact(f'API_KEY = "{key}"\n')[0] == "API_KEY = «redacted:openai-key»\n"
    assert redact(f"OPENAI_API_KEY='{key}'\n")[0] == "OPENAI_API_KEY=«redacted:openai-key»\n"
    assert redact('DB_PASSWORD = "p4ss w0rd!"\n')[0] == "DB_PASSWORD = «redacted:env-secret»\n"
    assert redact('token := "a9f8e7d6c5b4"\n')[0] == "token := «redacted:env-secret»\n"
    # after ':' the quotes stay, so JSON and YAML remain valid
    assert redact('{"password": "hunter22"}')[0] == '{"password": "«redacted:env-secret»"}'
    assert redact(f'{{"key": "{key}"}}')[0] == '{"key": "«redacted:openai-key»"}'
    # a mask that does not fill the quoted value keeps the quotes
    out = redact('DSN = "postgres://app:s3cretpw@db/atlas"\n')[0]
    assert out == 'DSN = "postgres://app:«redacted:connection-string»@db/atlas"\n'
    # comparison is not assignment
    assert redact(f'if key == "{key}":\n')[0] == 'if key == "«redacted:openai-key»":\n'


def test_colon_form_needs_quotes_or_a_fence():
    assert redact("Password: reset flow decided\n")[1]["total"] == 0
    # issue 30: a made-up value after "password:" is a password stated in prose
    assert redact("password: hunter22\n")[0] == "password: «redacted:env-secret»\n"
    assert redact("password: hunter\n")[1]["total"] == 0   # a word, not a made-up value
    assert redact('password: "hunter22"\n')[0] == 'password: "«redacted:env-secret»"\n'
    assert redact("'password': hunter22\n")[0] == "'password': «redacted:env-secret»\n"
    assert redact("```yaml\npassword: hunter22\n```\n")[0] == "```yaml\npassword: «redacted:env-secret»\n```\n"
    assert redact("```python\npassword: str\n```\n")[1]["total"] == 0
    # a lone token-shaped value ending its line is an assignment even outside a fence
    assert redact("api_token: 9f8e7d6c5b4a39281706f5e4\n")[0] == "api_token: «redacted:env-secret»\n"


def test_key_shapes():
    for key in ("DB_PASSWORD", "dbPassword", "db-pass", "PASSPHRASE", "client_secret", "clientSecret",
                "apiKey", "API-KEY", "x.api_key", "AccessKey", "private_key", "auth_token",
                "credentials", "session_key", "signingKey", "ENCRYPTION_KEY", "master_key", "MYSQL_PWD"):
        out = redact(f"{key}=Qm9v7Zt2Lp\n")[0]
        assert out == f"{key}=«redacted:env-secret»\n", key
    for key in ("passport", "bypass", "tokenizer", "secretary", "PASSWORD_URL", "token_type",
                "max_tokens", "keyboard", "monkey", "PWD"):
        assert redact(f"{key}=Qm9v7Zt2Lp\n")[1]["total"] == 0, key


def test_value_stops_at_separators():
    assert redact("password=hunter22;user=bob\n")[0] == "password=«redacted:env-secret»;user=bob\n"
    assert redact("password=hunter22, user=bob\n")[0] == "password=«redacted:env-secret», user=bob\n"
    assert redact("(see token=abc123def)\n")[0] == "(see token=«redacted:env-secret»)\n"
    assert redact("client(token=tok_value, password=pw)\n")[1]["total"] == 0
    assert redact("GET /cb?access_token=a1b2c3d4e5&state=xyz\n")[0] == \
        "GET /cb?access_token=«redacted:env-secret»&state=xyz\n"


# ------------------------------------------------------------------------------------------
# Report, hits, merge
# ------------------------------------------------------------------------------------------

def test_report_shape_and_summary():
    token = "ghp_" + rand(ALNUM, 36)
    text = f"line one\nDB_PASSWORD=hunter22\nuse {token}\n"
    out, report = redact(text, part="section:Raw excerpts")
    assert out == "line one\nDB_PASSWORD=«redacted:env-secret»\nuse «redacted:github-token»\n"
    assert report == {
        "total": 2, "counts": {"env-secret": 1, "github-token": 1},
        "summary": "redacted 2 (env-secret×1, github-token×1)",
        "hits": [{"kind": "env-secret", "part": "section:Raw excerpts", "line": 2},
                 {"kind": "github-token", "part": "section:Raw excerpts", "line": 3}]}
    assert "\u00d7" in report["summary"]
    assert list(report["counts"]) == sorted(report["counts"])
    assert "hunter22" not in repr(report) and token not in repr(report)
    assert redact("nothing here")[1] == {"total": 0, "counts": {}, "summary": "no secrets found", "hits": []}


def test_report_never_holds_a_value_over_the_corpus():
    for _k, _c, text, secrets, _w in CORPUS:
        report = repr(redact(text)[1])
        assert not any(s in report for s in secrets)


def test_merge_reports():
    a = redact("TOKEN=a1b2c3d4e5f6\n", part="digest")[1]
    b = redact("x\nghp_" + rand(ALNUM, 36) + "\nTOKEN=z9y8x7w6v5\n", part="section:Notes")[1]
    merged = merge_redaction_reports([a, b, redact("clean", part="notes")[1]])
    assert merged["total"] == 3
    assert merged["counts"] == {"env-secret": 2, "github-token": 1}
    assert merged["summary"] == "redacted 3 (env-secret×2, github-token×1)"
    assert merged["hits"] == [{"kind": "env-secret", "part": "digest", "line": 1},
                              {"kind": "github-token", "part": "section:Notes", "line": 2},
                              {"kind": "env-secret", "part": "section:Notes", "line": 3}]
    assert merge_redaction_reports([])["summary"] == "no secrets found"


def test_find_secrets_positions():
    token = "ghp_" + rand(ALNUM, 36)
    text = f"a\nb {token} c\nDB_PASSWORD='hunter22'\n"
    found = find_secrets(text)
    assert found == [
        {"kind": "github-token", "line": 2, "start": 4, "end": 4 + len(token)},
        {"kind": "env-secret", "line": 3, "start": text.index("hunter22"),
         "end": text.index("hunter22") + 8}]


# ------------------------------------------------------------------------------------------
# POLICY.patterns (docs/redaction.md § The contract)
# ------------------------------------------------------------------------------------------

def test_load_policy_patterns():
    text = ("# comment\n\n"
            "employee-id   \\bEMP-\\d{6}\\b\n"
            "  codename (?i)project (?:falcon|osprey)\n"
            "lonely\n"
            "bad[kind] foo\n"
            "broken (unclosed\n"
            "empty a*\n"
            "block (?s)BEGIN NOTE.*?END NOTE\n")
    rules, problems = load_policy_patterns(text)
    assert [k for k, _ in rules] == ["employee-id", "codename", "block"]
    assert rules[1][1].pattern == "(?i)project (?:falcon|osprey)"
    assert [p["line"] for p in problems] == [5, 6, 7, 8]
    assert problems[0]["text"] == "lonely"
    assert all(p["reason"] for p in problems)
    assert load_policy_patterns(memshelf.POLICY_PATTERNS_TEMPLATE) == ([], [])


def test_policy_rules_mask_after_builtins():
    rules, _ = load_policy_patterns("employee-id \\bEMP-\\d{6}\\b\ncodename (?i)project falcon\n"
                                    "note (?s)BEGIN NOTE.*?END NOTE\nsecretish password=\\S+\n")
    text = "EMP-123456 asked about Project Falcon.\nBEGIN NOTE\nprivate\nEND NOTE\npassword=hunter22\n"
    out, report = redact(text, rules)
    assert out == ("«redacted:employee-id» asked about «redacted:codename».\n«redacted:note»\n"
                   "password=«redacted:env-secret»\n")
    assert report["counts"] == {"codename": 1, "employee-id": 1, "env-secret": 1, "note": 1}
    # line rules never cross a line break
    rules, _ = load_policy_patterns("pair alpha\\s+beta\n")
    assert redact("alpha\nbeta", rules)[1]["total"] == 0
    assert redact("alpha beta", rules)[0] == "«redacted:pair»"
    # idempotent with user rules too, and find_secrets agrees
    once = redact(text, load_policy_patterns("codename (?i)project falcon\n")[0])[0]
    assert redact(once, load_policy_patterns("codename (?i)project falcon\n")[0])[1]["total"] == 0
    assert {f["kind"] for f in find_secrets(text, load_policy_patterns("e \\bEMP-\\d{6}\\b")[0])} >= {"e"}


def test_templates_are_english_prose_and_comments():
    assert all(line.startswith("#") or not line.strip()
               for line in memshelf.POLICY_PATTERNS_TEMPLATE.splitlines())
    assert "<kind>" in memshelf.POLICY_PATTERNS_TEMPLATE
    assert "POLICY.patterns" in memshelf.POLICY_MD_TEMPLATE
    assert "«redacted:<kind>»" in memshelf.POLICY_MD_TEMPLATE


# ------------------------------------------------------------------------------------------
# Per-shelf switches and memshelf-mcp 0.4.0 (docs/redaction.md § The contract)
# ------------------------------------------------------------------------------------------

def test_disable_switch():
    text = "DB_PASSWORD=hunter22\nuse ghp_" + rand(ALNUM, 36) + "\n"
    out, report = redact(text, disable=("env-secret",))
    assert "hunter22" in out and report["counts"] == {"github-token": 1}
    assert find_secrets(text, disable=["github-token", "env-secret"]) == []
    # a disabled kind stays off under legacy_compat too
    assert redact("MAX_TOKENS=4096\n", disable=("env-secret",), legacy_compat=True)[1]["total"] == 0
    # every kind can be switched off on its own
    for kind, _ctx, sample, secrets, _keep in CORPUS[:40]:
        out, report = redact(sample, disable=(kind,))
        assert kind not in report["counts"]


# 0.4.0's five at-rest rules, as observed by running memshelf-mcp 0.4.0 (written here from
# that behaviour): an oracle for "0.4.0's doctor would call this clean".
LEGACY_ORACLE = [
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\bsqu_[0-9a-f]{40}\b"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b"),
    re.compile(r"(?i)\bBearer\s+[A-Za-z0-9._\-]{16,}"),
    re.compile(r"(?i)\b[A-Za-z0-9_]*(?:TOKEN|SECRET|PASSWORD|PASSWD|PWD|API[_-]?KEY|ACCESS[_-]?KEY)"
               r"[A-Za-z0-9_]*\s*=\s*(?!«redacted:)\S+"),
]


def legacy_flags(text):
    return [m.group(0) for rx in LEGACY_ORACLE for m in rx.finditer(text)]


LEGACY_SAMPLES = [
    ("MAX_TOKENS=4096\n", "MAX_TOKENS=«redacted:env-secret»\n"),
    ("TOKEN=<your token>\n", "TOKEN=«redacted:env-secret»\n"),
    ('OPENAI_API_KEY="${OPENAI_API_KEY}"\n', "OPENAI_API_KEY=«redacted:env-secret»\n"),
    ("Authorization: Bearer YOUR_ACCESS_TOKEN_HERE\n", "Authorization: Bearer «redacted:bearer»\n"),
    ("Use AKIAIOSFODNN7EXAMPLE in docs.\n", "Use «redacted:aws-access-key» in docs.\n"),
    ("ghp_" + "x" * 36 + "\n", "«redacted:github-token»\n"),
    ("if token == expected:\n", None),
    ("password = getpass()\n", None),
    ("TOKEN = ${{ secrets.TOKEN }}\n", "TOKEN = «redacted:env-secret»\n"),
]


@pytest.mark.parametrize("text,expected", LEGACY_SAMPLES)
def test_legacy_compat_masks_what_040_flags(text, expected):
    assert legacy_flags(text)
    plain, _ = redact(text)
    out, report = redact(text, legacy_compat=True)
    assert legacy_flags(out) == []
    assert report["total"] >= 1
    if expected is not None:
        assert out == expected
    assert redact(out, legacy_compat=True) == (out, redact("", legacy_compat=True)[1])
    assert report["total"] > redact(text)[1]["total"] or plain == out


def test_legacy_compat_output_is_clean_under_040_rules_for_the_corpora():
    texts = [t for _k, _c, t, _s, _w in CORPUS] + [t for _n, t, _b in PRIVATE_KEYS] + BENIGN
    for text in texts:
        out, _ = redact(text, legacy_compat=True)
        assert legacy_flags(out) == [], text
    # without the switch, no mask is ever left quoted after '=' (0.4.0 flags those)
    for _k, _c, text, _s, _w in CORPUS:
        out, _ = redact(text)
        assert not re.search(r"=\s*[\"']«redacted:[^»]*»[\"']", out), out


def test_legacy_hits_have_lines_in_the_original_text():
    text = ("-----BEGIN PRIVATE KEY-----\n" + "\n".join(rand(B64, 64) for _ in range(5))
            + "\n-----END PRIVATE KEY-----\nMAX_TOKENS=4096\n")
    out, report = redact(text, legacy_compat=True)
    assert report["hits"] == [{"kind": "private-key", "part": "text", "line": 2},
                              {"kind": "env-secret", "part": "text", "line": 8}]
    found = find_secrets(text, legacy_compat=True)
    assert [f["line"] for f in found] == [2, 8]
    assert text[found[1]["start"]:found[1]["end"]] == "4096"


def test_against_installed_040_when_available():
    mcp = pytest.importorskip("memshelf_mcp.core.redact")
    for _k, _c, text, _s, _w in CORPUS:
        out, _ = redact(text, legacy_compat=True)
        assert mcp.scan(out).clean
    for text in BENIGN + [t for t, _e in LEGACY_SAMPLES]:
        assert mcp.scan(redact(text, legacy_compat=True)[0]).clean


# ------------------------------------------------------------------------------------------
# Robustness
# ------------------------------------------------------------------------------------------

ADVERSARIAL_UNITS = [
    "a", "token=", "glpat-", "-----BEGIN PRIVATE KEY-----\n", "x://a:", "Bearer ", "password=token=",
    "sk-", "eyJ" + "a" * 20 + ".", "AKIA", "'password': '", "Cookie: a=b;", "mysql -p", "\\n",
    "X-API-Key-", "a-", "kind: Secret\ndata:\n  k: v\n", "===", "«redacted:", "${{ ", "Q~", ":AA",
]


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["password=token=", "'password': '", "-----BEGIN PRIVATE KEY-----\n",
                                  "kind: Secret\ndata:\n  k: v\n", "eyJ" + "a" * 20 + "."])
def test_adversarial_megabyte_returns(unit):
    text = unit * (1_000_000 // len(unit))
    out, report = redact(text, legacy_compat=True)
    assert isinstance(out, str) and isinstance(report["total"], int)


@pytest.mark.slow
def test_adversarial_mixed_megabyte_returns():
    rng = random.Random(7)
    parts, size = [], 0
    while size < 1_000_000:
        unit = rng.choice(ADVERSARIAL_UNITS) * rng.randint(1, 400)
        parts.append(unit)
        size += len(unit)
    text = "".join(parts)
    assert isinstance(find_secrets(text), list)


def test_crlf_and_unicode():
    text = "DB_PASSWORD=hunter22\r\nnote: café ☕\r\n"
    assert redact(text)[0] == "DB_PASSWORD=«redacted:env-secret»\r\nnote: café ☕\r\n"


def test_rejects_non_text():
    with pytest.raises(TypeError):
        redact(b"TOKEN=abc")


def test_prefilters_keep_every_context_of_a_token():
    # The anchor word gate: a token opens a word after any punctuation, also in a long run;
    # glued to a word it is something else; a short token counts only in a long run.
    token = "ghp_" + rand(ALNUM, 36)
    doppler = "dp.pt." + rand(ALNUM, 42)
    for left in (" ", "(", '"', "=", "«x» ", "é", "/", ":", "\n"):
        for value, kind in ((token, "github-token"), (doppler, "doppler-token")):
            hits = find_secrets("see" + left + value + ".")
            assert [h["kind"] for h in hits] == [kind], (left, value)
    assert find_secrets("xghp_" + token[4:]) == find_secrets("a-" + token) == []
    short = "xoxb-" + rand(DIGITS, 10)
    assert find_secrets("token " + short + " here") == []
    assert [h["kind"] for h in find_secrets("token " + short + ".and.more.text")] == \
        ["slack-token"]


def test_prefilters_read_keywords_in_any_case():
    # The gates look at lower-cased words; the rules themselves keep their own case rules.
    secret = rand(ALNUM, 24)
    cases = {
        f"DB_PASSWORD={secret}": "env-secret",
        f"Authorization: BEARER {secret}": "bearer",
        f"X-API-KEY: {secret}": "api-key-header",
        f"COOKIE: SESSIONID={secret}": "session-cookie",
        f"MYSQL -u root -p{secret}": None,
        f"mysql -u root -p{secret}": "cli-password",
        f"Server=db;Database=app;PASSWORD={secret};": "connection-string",
        f"//registry.npm.example/:_AUTHTOKEN={secret}": "npm-token",
        f"curl --TOKEN {secret}": None,
        f"curl --token {secret}": "cli-password",
    }
    for text, kind in cases.items():
        assert [h["kind"] for h in find_secrets(text)] == ([kind] if kind else []), text


# ------------------------------------------------------------------------------------------
# Taint: a value found once is masked at every occurrence, in every part
# ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_repeated_secret_masked_in_every_part_of_a_shelved_episode(shelf, cli):
    value = rand(ALNUM, 24)
    r = cli("shelve", "--shelf", shelf, "--slug", "2026-07-22-token-leak", "--kind", "topic",
                "--digest", f"Dana rotated the API token {value} after the leak. Open: audit.",
                "--section", f"Decisions=export API_TOKEN={value}\nlater the log printed {value}",
                "--section", f"Notes=old value {value}.", "--description", f"Token {value} rotated",
                "--notes", f"was {value}", "--display-title", f"Leak of {value}",
                "--session", f"s-{value}", "--json")
    assert r.code == 0, r
    assert r.json()["redaction"]["counts"] == {"env-secret": 8}
    text = (shelf / "docs" / "topics" / "2026-07-22-token-leak.md").read_text()
    assert value not in text and text.count("«redacted:env-secret»") == 8
    for root, _dirs, files in os.walk(shelf):
        for name in files if ".git" not in root else ():
            with open(os.path.join(root, name), errors="replace") as f:
                assert value not in f.read(), name


def test_taint_in_redact_find_secrets_and_policy_rules():
    value = "Zt9" + rand(ALNUM, 17)
    text = f"DB_PASSWORD='{value}'\nthe log said {value}; retry with ({value})\n"
    out, report = redact(text)
    assert value not in out and report["counts"] == {"env-secret": 3}
    assert [f["line"] for f in find_secrets(text)] == [1, 2, 2]
    # inside a longer word it is another value; a lone short word is never tainted
    assert redact(f"password={value}\nx{value}y\n")[0] == f"password=«redacted:env-secret»\nx{value}y\n"
    assert redact("https://u:postgres@db.acme.io/x\npostgres is up\n")[0] == \
        "https://u:«redacted:connection-string»@db.acme.io/x\npostgres is up\n"
    rules, _ = load_policy_patterns("ticket (?<=ticket: )[A-Z0-9]{10}\n")
    out, report = redact("ticket: AB12CD34EF\nagain AB12CD34EF\n", rules)
    assert out == "ticket: «redacted:ticket»\nagain «redacted:ticket»\n"


def test_redact_parts_share_the_taint():
    value = rand(ALNUM, 20) + "7"
    outs, report = memshelf.redact_parts([("digest", f"saw {value}"), ("notes", None),
                                         ("section:Raw", f"export SECRET_KEY={value}\n")])
    assert outs == ["saw «redacted:env-secret»", None, "export SECRET_KEY=«redacted:env-secret»\n"]
    assert report["hits"] == [{"kind": "env-secret", "part": "digest", "line": 1},
                              {"kind": "env-secret", "part": "section:Raw", "line": 1}]
    # idempotent as a whole
    assert memshelf.redact_parts([("a", o) for o in outs if o])[1]["total"] == 0


# ------------------------------------------------------------------------------------------
# Whole values, the formats of issue 19 (positive and near miss) and its false positives
# ------------------------------------------------------------------------------------------

def test_passwords_masked_to_their_real_end():
    assert redact("curl -u elastic:P@ssw0rd$1 https://es.acme.io:9200/_cat\n")[0] == \
        "curl -u elastic:«redacted:cli-password» https://es.acme.io:9200/_cat\n"
    assert redact("curl -u user:P@ss$word! https://x.acme.io\n")[0] == \
        "curl -u user:«redacted:cli-password» https://x.acme.io\n"
    assert redact("curl --user 'ops:a%b:c/d@e' https://x.acme.io\n")[0] == \
        "curl --user 'ops:«redacted:cli-password»' https://x.acme.io\n"
    # the URL's @host boundary is the last @ before the host
    assert redact("https://user:P@ss:w$rd!@db.acme.io/x\n")[0] == \
        "https://user:«redacted:connection-string»@db.acme.io/x\n"
    assert redact("run --password=P@ss:w/rd!% now\n")[0] == "run --password=«redacted:cli-password» now\n"
    assert redact("curl --user=admin:Zx9kL2mQ7pW! https://x.acme.io\n")[0] == \
        "curl --user=admin:«redacted:cli-password» https://x.acme.io\n"
    assert redact('curl -u ":Zx9kL2mQ7pW" https://x.acme.io\n')[0] == \
        'curl -u ":«redacted:cli-password»" https://x.acme.io\n'


def _formats():
    """(positive text, the secret in it, a near miss that stays byte for byte)."""
    out = []

    def add(template, secret, near_miss):
        out.append((template.replace("@", secret), secret, near_miss))
    add('"SecretAccessKey": "@"', rand(B64, 40), '"SecretAccessKey": "${AWS_SECRET}"')
    add("aws_secret = @", rand(B64, 40), "aws_secret = {{ .Values.awsSecret }}")
    add("key @", "da2-" + rand(LOWER + DIGITS, 26), f"build da2-{rand(LOWER + DIGITS, 20)}")
    add("@", "ABSK" + rand(B64, 120), f"ABSK{rand(B64, 60)}")
    add("@", "rk_prod_" + rand(ALNUM, 40), f"pk_prod_{rand(ALNUM, 40)}")
    add("@", f"sk-ant-admin01-{rand(URLSAFE, 93)}AA", f"sk-ant-admin01-{rand(ALNUM, 10)}")
    add("@", f"sgp_{rand(HEX, 16)}_{rand(HEX, 40)}", f"sgp_{rand(HEX, 16)}_{rand(HEX, 39)}")
    add("token @", "EAAC" + rand(ALNUM, 120), f"token EAAB{rand(ALNUM, 120)}")
    add("@", "A3-" + "-".join(rand(UPPER + DIGITS, n) for n in (6, 11, 5, 5, 5)),
        "A3-" + "-".join(rand(UPPER + DIGITS, n) for n in (6, 11, 5, 5)))
    add("FLY=@", "fm2_" + rand(B64, 120), f"see fm2_{rand(B64, 50)}")
    add("TWILIO_AUTH_TOKEN=@", rand(HEX, 32), "TWILIO_AUTH_TOKEN=${TWILIO_AUTH_TOKEN}")
    add('twilio_account_sid: "@"', "AC" + rand(HEX, 32), 'twilio_account_sid: "ACCOUNT_SID"')
    add('{"value": "@"}', "glpat-" + rand(URLSAFE, 20), f'{{"value": "glpat-{rand(ALNUM, 10)}"}}')
    add('{"k": "-----BEGIN RSA PRIVATE KEY-----\\n@\\n-----END RSA PRIVATE KEY-----"}', "MIIE" + rand(B64, 60),
        '{"k": "-----BEGIN PUBLIC KEY-----\\nMIIB' + rand(B64, 60) + '\\n-----END PUBLIC KEY-----"}')
    add("@", "hvb." + rand(URLSAFE, 140), f"hvb.{rand(URLSAFE, 10)}")
    add("curl -H 'Authorization: Basic @' https://x", rand(ALNUM, 40) + "=",
        "curl -H 'Authorization: Basic $CREDS' https://x")
    add("curl -H 'Authorization: Token @' https://x", rand(ALNUM, 40),
        "curl -H 'Authorization: Token <token>' https://x")
    add("apikey: @", rand(ALNUM, 32), "apikey: your-api-key-here")
    add("AZURE_STORAGE_KEY=@", rand(B64, 86) + "==", "AZURE_STORAGE_KEY=<storage-key>")
    add("AZURE_SAS=sv=2022-11-02&ss=b&sp=r&sig=@", rand(ALNUM, 40) + "%3D", "sig=abc def")
    add('"refresh_token": "@"', "0.AXoA" + rand(URLSAFE, 120), '"refresh_token": "<refresh token>"')
    add("AZURE_OPENAI_API_KEY=@", rand(HEX, 32), "AZURE_OPENAI_ENDPOINT=https://x.openai.azure.com")
    add("SUMO_ACCESS_ID=@", "su" + rand(ALNUM, 6) + "7" + rand(ALNUM, 5), "SUMO_ACCESS_ID=sumo_collector_prod")
    add("SUMO_ACCESS_KEY=@", rand(ALNUM, 64), "SUMO_ACCESS_KEY=${SUMO_KEY}")
    add("algolia_key: '@'", rand(LOWER + DIGITS, 32), "algolia_key: 'search_only_index'")
    add("DATADOG_API=@", rand(LOWER + DIGITS, 40), "datadog_api: enabled")
    add("x @", "pscale_tkn_" + rand(ALNUM, 43), f"x pscale_tkn_{rand(ALNUM, 20)}")
    add("x @", f"pat{rand(ALNUM, 14)}.{rand(HEX, 64)}", f"x pattern.{rand(HEX, 64)}")
    add("x @", "API-" + rand(UPPER + DIGITS, 26), "x API-GATEWAY-" + rand(UPPER, 20))
    add("x @", "eyJrIjoi" + rand(ALNUM, 80), "x eyJrIjoi" + rand(ALNUM, 20))
    add("x @", "A3T" + rand(UPPER + DIGITS, 17), "x A3T" + rand(UPPER + DIGITS, 10))
    return out


FORMATS = _formats()


@pytest.mark.parametrize("positive,secret,near_miss", FORMATS, ids=[str(i) for i in range(len(FORMATS))])
def test_issue_formats_and_their_near_misses(positive, secret, near_miss):
    out, report = redact(positive + "\n")
    assert report["total"] >= 1 and secret not in out and secret[-12:] not in out
    assert redact(near_miss + "\n") == (near_miss + "\n", redact("")[1])


ISSUE_FALSE_POSITIVES = [
    "curl -u 'test:test' https://api.acme.io\n",
    'curl --user "xxx:yyy" https://api.acme.io\n',
    "curl -u <user:password> https://api.acme.io\n",
    "slack dummy xoxb-abcdef-abcdef in the docs\n",
    '{"token": "xoxp-1234567890"}\n',
    "password=secret123\n",
    'iam_api_key="%s" % NAME\n',
    "- (id)hf_requiredCharacteristicTypesForSharingCategory;\n",
    'API_KEY="{}".format(key)\nurl = f"https://x/{token}"\n',
    "TOKEN=aaaaaaaaaaaaaaaaaaaa\nSECRET_KEY=1234567890123456\n",
    "# public key: age1ql3z7hjy54pw3hyww5ayyfg7zqgvc7w3j2elw8zmrj2kg5sfn9aqmcac8p\n",
    "commit a94a8fe5ccb19ba61c4c0873d391e987982fbbd3 and sha_key: e3b0c44298fc1c149afbf4c8996fb924\n",
    "Authorization: Basic dXNlcjpwYXNzd29yZA==\n",   # user:password
    'tokenizer = "cl100k_base"\nkey_id = "3f9c2a7d1e4b5c6a"\nsort_key: "createdAt"\n',
    'api_key_env = "OPENAI_API_KEY"\nkeyPrefix: "sk_live_"\nauth_type = "oauth2_client_credentials"\n',
    'gpg_key_id = "3AA5C34371567BD2"\nidempotency_key = "7c9e6679-7425-40de-944b-e07fc1f90ae7"\n',
    "--token-file /run/secrets/token --api-key-env OPENAI_API_KEY --key-file ~/.ssh/id_ed25519\n",
]


@pytest.mark.parametrize("text", ISSUE_FALSE_POSITIVES)
def test_issue_false_positives_stay_byte_identical(text):
    assert redact(text)[0] == text
    assert find_secrets(text) == []


def _github(prefix, body30):
    import zlib
    crc, digits = zlib.crc32(body30.encode()), ""
    while crc:
        crc, r = divmod(crc, 62)
        digits = (DIGITS + UPPER + LOWER)[r] + digits
    return prefix + body30 + digits.rjust(6, "0")


def test_checksummed_formats_use_their_checksum():
    # a low-entropy body passes when its CRC32 is right and fails when it is not
    plain = "abcabcabcabcabcabcabcabcabcab1"
    for prefix, kind in (("ghp_", "github-token"), ("npm_", "npm-token")):
        good = _github(prefix, plain)
        bad = good[:-1] + ("0" if good[-1] != "0" else "1")
        assert redact(f"t {good}\n")[0] == f"t «redacted:{kind}»\n"
        assert redact(f"t {bad}\n")[0] == f"t {bad}\n"
        # a random body is a token with or without a valid checksum (older test data)
        assert find_secrets(prefix + rand(ALNUM, 36))
    pypi = "pypi-AgEIcHlwaS5vcmc" + "abcd" * 13
    assert find_secrets(pypi + "a") and not find_secrets(pypi + "ab")   # base64url decodes or not


SCANNER_SHAPES = [   # how scanners' own samples put a service key next to its name
    'adafruitToken := "@"', 'var adafruitToken string = "@"', 'adafruit_api_token = "@"',
    '{"adafruit_api_token": "@"}', 'string adafruitToken = "@";', 'System.setProperty("ADAFRUIT_API_TOKEN", "@")',
    '$adafruit_api_token .= "@"', 'adafruitToken ?= "@"', 'adafruitToken ::= "@"', 'adafruitToken :::= "@"',
    "<adafruitToken>\n    @\n</adafruitToken>", 'adafruitToken, err := "@"', "adafruit_token => '@'",
    'adafruit_client_secret ||= "@"', '"adafruit_key", "@"', 'config.adafruitToken("@")',
    "--adafruit-token @", "curl -H 'apikey: @' https://x.acme.io", '<add key="StorageKey" value="@" />',
]


@pytest.mark.parametrize("shape", SCANNER_SHAPES)
def test_generic_rule_takes_scanner_shapes(shape):
    value = rand(ALNUM, 20) + "7q"
    out = redact(shape.replace("@", value) + "\n")[0]
    assert value not in out and "«redacted:" in out
    # the same shape with a templated value is left alone, and where only the loose form of
    # rule (a) reads it, a word-shaped value too
    benign = ["${ADAFRUIT_TOKEN}"] + (["refresh_token_v2"] if shape in LOOSE_ONLY else [])
    for value in benign:
        assert redact(shape.replace("@", value) + "\n")[0] == shape.replace("@", value) + "\n"


LOOSE_ONLY = {s for s in SCANNER_SHAPES if any(m in s for m in (
    " string ", "setProperty", ".=", "?=", "::=", ", err", "||=", '_key", ', "Token(", "--ada", "<add"))}


def test_generic_rule_leaves_hashes_ids_and_paths_under_other_keys():
    for text in (f'commit_sha = "{rand(HEX, 40)}"', f'key_id = "{rand(HEX, 16)}"', f'cache_key("{rand(HEX, 32)}")',
                 's3_key = "uploads/2024/report_123.pdf"', "--sort-key created_at_12", "monkey = 'banana12'",
                 f"public_key: {rand(B64, 44)}", "the key: sorted by name"):
        assert redact(text + "\n")[0] == text + "\n", text


def test_generic_rule_takes_comparisons_bare_quotes_and_arrays():
    value = rand(ALNUM, 22) + "9"
    for shape in ('if (db_pass == "@")', 'private_key "@"', 'char password[] = "@";',
                  'password = "m{{h}o)p${e]nob(ody[@}"'):
        assert value not in redact(shape.replace("@", value))[0], shape
    # a template or format slot with little else is a placeholder; a password with $ is not
    assert redact('password = "%(pw)s"\nAPI_KEY="{}"\n')[1]["total"] == 0
    assert redact('password = "pa$word1"\n')[1]["total"] == 1


# ------------------------------------------------------------------------------------------
# Beyond one episode: the shelf's local taint memory (.memshelf/taint)
# ------------------------------------------------------------------------------------------

def _shelve(cli, shelf, slug, section):
    r = cli("shelve", "--shelf", shelf, "--slug", slug, "--kind", "topic", "--json",
            "--digest", "Dana rotated the deploy credentials after the audit. Open: the CI job.",
            "--section", "Decisions=" + section)
    assert r.code == 0, r
    return (shelf / "docs" / "topics" / f"{slug}.md")


@pytest.mark.slow
def test_a_masked_token_is_masked_when_it_comes_back_bare_in_a_later_episode(shelf, cli):
    token, password = rand(ALNUM, 30) + "7", rand(ALNUM, 24) + "5"
    _shelve(cli, shelf, "2026-07-22-rotation", f"export DEPLOY_TOKEN={token}\n"
            f"curl -u ops:{password} https://ci.acme.io")
    memory = (shelf / ".memshelf" / "taint").read_text()
    assert token not in memory and password not in memory and memory.count("\n") == 2
    later = _shelve(cli, shelf, "2026-07-23-ci-job", f"The job still sent {token} and {password}.")
    text = later.read_text()
    assert token not in text and "«redacted:env-secret»" in text
    assert password in text   # passwords are never remembered beyond their episode
    # doctor and the scan verb use the same memory for what is already on disk
    later.write_text(text.replace(password, token))
    r = cli("doctor", "--shelf", shelf, "--json")
    found = [f for f in r.json()["findings"] if f["code"] == "secret-at-rest"]
    assert [f["path"] for f in found] == ["docs/topics/2026-07-23-ci-job.md"] and token not in r.out
    r = cli("scan", "--shelf", shelf, later, "--json")
    assert r.json()["findings"] and token not in r.out
    # the memory stays out of git
    assert ".memshelf" not in subprocess.run(["git", "-C", str(shelf), "ls-files"],
                                             capture_output=True, text=True).stdout


def test_redaction_bench_runs_and_its_corpus_stays_clean():
    # bench/redaction.py must keep running; its own corpus is a regression check (no timing here)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "redaction.py"),
                        "--n", "2", "--mb", "0.02", "--repeat", "1", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["recall_all"] >= 0.97 and result["fp_rate"] <= 0.01
