"""Whether a package registry can be reached, for the venv scripts (engine_venv.sh, quantizer_venv.sh).

    python registry_probe.py INDEX_URL PACKAGE LABEL

Exit 0: it answered (an HTTP error is an answer, and pip then reports it as a failure), or the index
is local (pip says what is wrong with it).  Exit 3: unreachable (a failed name lookup, a refused or
timed-out connection), with one line on stderr: "LABEL: skipped, the package registry URL cannot be
reached (REASON)".  Anything else raises.
"""

import os
import socket
import ssl
import sys
import urllib.error
import urllib.request

index, package, label = sys.argv[1:4]
url = index.rstrip("/") + f"/{package}/"
if not url.startswith(("http://", "https://")):
    sys.exit(0)
context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
try:
    urllib.request.urlopen(url, timeout=30, context=context).close()
except urllib.error.HTTPError:
    pass
except (urllib.error.URLError, OSError) as e:
    reason = getattr(e, "reason", e)
    if isinstance(reason, (socket.gaierror, socket.timeout, TimeoutError, ConnectionError)) or (
            isinstance(reason, OSError) and reason.errno in (101, 113)):  # ENETUNREACH, EHOSTUNREACH
        print(f"{label}: skipped, the package registry {url} cannot be reached ({reason})", file=sys.stderr)
        sys.exit(3)
    raise
