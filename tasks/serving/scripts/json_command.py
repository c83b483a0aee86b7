"""The command line both serving-environment scripts share: `SCRIPT COMMAND < request.json` runs
one command on a JSON request and prints its JSON answer on stdout, alone (libraries print to
stdout too: it is pointed at stderr while the command runs). Standard library only."""

from __future__ import annotations

import json
import sys
from typing import Callable


def run(script: str, commands: dict[str, Callable[[dict], dict]]) -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        print(f"usage: {script} {{{'|'.join(commands)}}} < request.json", file=sys.stderr)
        return 2
    request = json.load(sys.stdin)
    stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        answer = commands[sys.argv[1]](request)
    finally:
        sys.stdout = stdout
    print(json.dumps(answer))
    return 0
