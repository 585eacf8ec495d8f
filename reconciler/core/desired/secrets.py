"""Secrets given inline in the desired state, recognised by name and by value.

The desired state lives in git and is copied to every host, so a secret must
never be written in it: an environment variable that carries one is given as
`<NAME>_FILE` with the absolute path of a file that stays on the host (the
unit reads it through LoadCredential=). This module says whether an
environment variable or an argv element looks like a secret, and what kind,
so the message can say why without ever repeating the value.

Pure: string rules only (the regular expressions and thresholds below).
"""

from __future__ import annotations

import math
import re
from collections import Counter

# --------------------------------------------------------------------------
# By name.
#
# A name is split into its underscore-separated words and a word counts only
# when it is one of SECRET_WORDS as a whole, so TOKENIZERS_PARALLELISM,
# KEYBOARD_LAYOUT, PASSTHROUGH_MODE and PRIVATEER_HOME pass while API_KEY,
# GH_TOKEN, SMTP_PASS and SSH_PRIVATE_KEY are refused. Names glued together
# without an underscore are caught through SECRET_COMPOUNDS, which may appear
# anywhere in a word (DBPASSWORD, MYAPIKEY, AWS_SECRETACCESSKEY): they are
# long and specific enough not to occur by accident. PWD is not a word here:
# it is the working directory.
SECRET_WORDS = frozenset(
    {
        "KEY",
        "KEYS",
        "TOKEN",
        "TOKENS",
        "SECRET",
        "SECRETS",
        "PASS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASSPHRASE",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "DSN",
        "PRIVATE",
    }
)
SECRET_COMPOUNDS = (
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "APIKEY",
    "ACCESSKEY",
    "SECRETKEY",
    "PRIVATEKEY",
    "AUTHKEY",
    "AUTHTOKEN",
    "ACCESSTOKEN",
    "REFRESHTOKEN",
    "CLIENTSECRET",
    "CREDENTIAL",
)
# Whole-name endings kept from the first list: a database's or a queue's URL
# carries its password in practice (PHAZE_DATABASE_URL, PHAZE_QUEUE_URL).
SECRET_NAME_SUFFIXES = ("DATABASE_URL", "QUEUE_URL")


def secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret."""
    upper = name.upper()
    if upper.endswith(SECRET_NAME_SUFFIXES):
        return True
    words = [w for w in upper.split("_") if w]
    # PWD alone is the working directory; as the last word of a longer name
    # it is a password (MYSQL_PWD, mysql's own variable for one).
    if len(words) > 1 and words[-1] == "PWD":
        return True
    return any(w in SECRET_WORDS or any(c in w for c in SECRET_COMPOUNDS) for w in words)


# --------------------------------------------------------------------------
# By value. Each rule is (kind, pattern); the kind goes into the message.

_NOT_ALNUM_BEFORE = r"(?<![A-Za-z0-9])"
_TOKEN_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a PEM block (a private key or certificate)", re.compile(r"-----BEGIN")),
    ("a GitHub token", re.compile(_NOT_ALNUM_BEFORE + r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})")),
    ("a Slack token", re.compile(_NOT_ALNUM_BEFORE + r"(?:xox[abprs]-[A-Za-z0-9-]{10,}|xapp-[A-Za-z0-9-]{10,})")),
    ("a Slack webhook URL", re.compile(r"hooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9/_-]{8,}")),
    ("an AWS access key id", re.compile(_NOT_ALNUM_BEFORE + r"(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")),
    ("a GitLab token", re.compile(_NOT_ALNUM_BEFORE + r"glpat-[A-Za-z0-9_-]{20,}")),
    ("a Tailscale key", re.compile(_NOT_ALNUM_BEFORE + r"tskey-[a-z]+-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(_NOT_ALNUM_BEFORE + r"AIza[0-9A-Za-z_-]{35}")),
    ("an API secret key", re.compile(_NOT_ALNUM_BEFORE + r"(?:sk|rk)[-_](?:live_|test_|proj-)?[A-Za-z0-9_-]{20,}")),
    ("a JSON web token", re.compile(_NOT_ALNUM_BEFORE + r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    # An HTTP credential as a header carries it ("Authorization: Bearer ...").
    ("a bearer token", re.compile(r"(?i)" + _NOT_ALNUM_BEFORE + r"bearer\s+[A-Za-z0-9._~+/=-]{16,}")),
    # 64 hex digits: a 256-bit key as openssl rand -hex 32 prints it. A digest
    # names its algorithm (sha256:..., @sha256:...), which this leaves alone;
    # a git commit is 40 digits.
    ("a 64-digit hex key", re.compile(r"(?<![A-Za-z0-9:@=-])[0-9a-fA-F]{64}(?![0-9a-fA-F])|(?<==)[0-9a-fA-F]{64}(?![0-9a-fA-F])")),
    # A password in a key=value connection string or option
    # ("host=db password=x", "--password=x", "?token=x"); "--password-file=" is not one.
    (
        "a password in key=value form",
        re.compile(
            r"(?i)(?<![A-Za-z0-9])(?:password|passwd|pwd|passphrase|secret|client_secret|token|access_token|api_?key)"
            r"\s*=\s*(?!['\"]?(?:/|$))[^\s&;]+"
        ),
    ),
)

# scheme://authority...: the authority ends at the first '/', '?' or '#'
# (RFC 3986), its user information before the last '@', the password after
# the first ':' of that. `https://host:8443/a@b` has no user information.
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#\s]*)")


def _url_with_password(value: str) -> bool:
    for match in _URL_RE.finditer(value):
        userinfo, at, _ = match.group(1).rpartition("@")
        if at and ":" in userinfo and userinfo.partition(":")[2]:
            return True
    return False


# A long random string: base64, base64url or a token alphabet. The thresholds:
# - at least HIGH_ENTROPY_MIN_LENGTH (32) characters: shorter strings are
#   ids, versions, words; a key or token of 128 bits or more in base64 is 22+
#   characters and real ones are 32+ (40 for GitHub, 44 for a 32-byte key);
# - Shannon entropy of at least HIGH_ENTROPY_MIN_BITS (4.0) bits a character:
#   random base64 of 32 characters scores 4.1-5.0 (4.56 on average), hex at
#   most 4.0 (16 symbols) and 3.9 in practice;
# - upper case, lower case and digits all present: hex digests (sha256:...,
#   git commits), UUIDs, lower-case paths and words lack one of them (a bare
#   64-digit hex key is caught by its own shape above);
# - the character class (upper, lower, digit, other) changes between at least
#   HIGH_ENTROPY_MIN_SWITCHES (40 %) of neighbouring characters: random base64
#   switches at 64 % on average (under 40 % for 1 in 100 of 32 characters),
#   while long CamelCase names, which also score 4.1-4.4 bits
#   (OrgApacheKafkaStringSerializer2026...), switch at 25-36 %.
# Together they miss about 3 % of random 32-character base64 strings and
# fewer of longer ones; that is the price of passing ordinary names.
# Paths are cut at '/' (each segment judged on its own) and '.', ':', '@',
# spaces and commas cut everything, so image references, host:port lists and
# dotted module names are never one long run.
HIGH_ENTROPY_MIN_LENGTH = 32
HIGH_ENTROPY_MIN_BITS = 4.0
HIGH_ENTROPY_MIN_SWITCHES = 0.4
_RUN_RE = re.compile(rf"[A-Za-z0-9+/=_-]{{{HIGH_ENTROPY_MIN_LENGTH},}}")


def shannon_entropy(text: str) -> float:
    """Bits per character of `text`'s own character distribution."""
    if not text:
        return 0.0
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _class(char: str) -> int:
    return 0 if char.isupper() else 1 if char.islower() else 2 if char.isdigit() else 3


def class_switches(text: str) -> float:
    """The share of neighbouring characters of different classes (upper, lower, digit, other)."""
    if len(text) < 2:
        return 0.0
    return sum(_class(a) != _class(b) for a, b in zip(text, text[1:], strict=False)) / (len(text) - 1)


def _random_looking(run: str) -> bool:
    run = run.rstrip("=")
    return (
        len(run) >= HIGH_ENTROPY_MIN_LENGTH
        and any(c.isupper() for c in run)
        and any(c.islower() for c in run)
        and any(c.isdigit() for c in run)
        and shannon_entropy(run) >= HIGH_ENTROPY_MIN_BITS
        and class_switches(run) >= HIGH_ENTROPY_MIN_SWITCHES
    )


def _high_entropy(value: str) -> bool:
    for match in _RUN_RE.finditer(value):
        run = match.group(0)
        start = match.start()
        # A path (the run starts at '/' or follows '~' or '.') is judged segment by segment.
        is_path = run.startswith("/") or (start > 0 and value[start - 1] in "~.")
        parts = run.split("/") if is_path or "//" in run else [run]
        if any(_random_looking(p) for p in parts):
            return True
    return False


def secret_value_kind(value: str) -> str | None:
    """What kind of secret `value` looks like ("a GitHub token", ...), or None."""
    for kind, pattern in _TOKEN_SHAPES:
        if pattern.search(value):
            return kind
    if _url_with_password(value):
        return "a URL with a password"
    if _high_entropy(value):
        return "a long random string"
    return None


# --------------------------------------------------------------------------
# Messages. None of them quotes the value.


def env_name_reason(name: str) -> str:
    return f"looks like a secret given inline; put it in a file on the host and give that file's absolute path as {name}_FILE (the unit reads it with LoadCredential=)"


def env_value_reason(name: str, kind: str) -> str:
    file_name = name if name.endswith("_FILE") else f"{name}_FILE"
    return (
        f"the value looks like {kind}, a secret given inline; put it in a file on the host "
        f"and give that file's absolute path as {file_name} (the unit reads it with LoadCredential=)"
    )


def argument_reason(kind: str) -> str:
    return (
        f"looks like {kind}, a secret given inline on a command line; put it in a file on the host "
        "and pass the file's absolute path instead (for a service, as a <NAME>_FILE environment variable, "
        "read with LoadCredential=)"
    )


def free_text_reason(kind: str) -> str:
    return (
        f"looks like {kind}: the desired state is in git and on every host, and this text lands in "
        "world-readable unit files and pages; keep secrets in files on the host"
    )


def environment_secret(name: str, value: object) -> str | None:
    """Why the environment variable `name = value` is a secret given inline, or None.

    A `<NAME>_FILE` variable holds a path, so only its value is judged (a
    token pasted where the path belongs); any other name is judged by name,
    then by value. A secret-sounding name holding an absolute path passes
    (GOOGLE_APPLICATION_CREDENTIALS, SSL_KEY_PATH): the file stays on the
    host. A value that is not a string is judged by its name only.
    """
    kind = secret_value_kind(value) if isinstance(value, str) else None
    if kind is None and isinstance(value, str) and _ABS_PATH_RE.match(value):
        return None
    if not name.endswith("_FILE") and secret_name(name):
        return env_name_reason(name)
    if kind is not None:
        return env_value_reason(name, kind)
    return None


# An absolute path with no whitespace: not a secret, whatever the name.
_ABS_PATH_RE = re.compile(r"^/[^\s]*$")
