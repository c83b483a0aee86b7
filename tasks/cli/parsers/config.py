"""`specdec config show|register|promote|rollback|export`'s parsers (run by tasks.cli.config)."""

from __future__ import annotations

from specdec_core.home import DEFAULT_MODEL

from ..common import output_file, tracking_uri_arg, url_arg
from . import Command


def register(sub) -> None:
    config = sub.add_parser("config", help="the promoted config in the MLflow registry")
    c_sub = config.add_subparsers(dest="config_command", required=True)

    def common(parser, url: bool = False):
        parser.add_argument("--target", default=DEFAULT_MODEL, help="target id (names the registered model)")
        tracking_uri_arg(parser)
        if url:
            url_arg(parser)

    show = c_sub.add_parser("show", help="a version: aliases, tags, description (per-domain table)")
    show.add_argument("which", nargs="?", default="champion", help="champion | challenger | VERSION")
    show.add_argument("--json", action="store_true")
    common(show, url=True)
    show.set_defaults(func=Command("tasks.cli.config:cmd_show"))
    reg = c_sub.add_parser("register", help="track a run in MLflow and register its config (challenger)")
    reg.add_argument("run_id")
    common(reg, url=True)
    reg.set_defaults(func=Command("tasks.cli.config:cmd_register"))
    prom = c_sub.add_parser("promote", help="gate, then move the champion alias (compare-and-set)")
    prom.add_argument("version")
    prom.add_argument("--force", action="store_true", help="promote past failed gates (recorded)")
    prom.add_argument("--expected-champion", default=None,
                      help="the champion version the gates were reviewed against ('none' if none); "
                           "refused if it has changed")
    common(prom, url=True)
    prom.set_defaults(func=Command("tasks.cli.config:cmd_promote"))
    back = c_sub.add_parser("rollback", help="champion back to the version it replaced")
    back.add_argument("--expected-champion", default=None, metavar="N",
                      help="roll back only if version N is still the champion (default: whatever is)")
    common(back, url=True)
    back.set_defaults(func=Command("tasks.cli.config:cmd_rollback"))
    export = c_sub.add_parser("export", help="a version as JSON, or as each serving engine's "
                                             "speculative settings per domain")
    export.add_argument("which", nargs="?", default="champion")
    export.add_argument("--format", choices=["json", "vllm", "trtllm", "sglang", "compose"],
                        default="json",
                        help="json: the config; vllm / trtllm: each engine's speculative_config "
                             "per domain (K by batch size in the engine's own key); sglang: the "
                             "launch_server flags per domain (one K per server); compose: a Docker "
                             "Compose override with one vLLM service per deployment (profile serving)")
    export.add_argument("--output", type=output_file("--output"), default=None, help="the file to write, in a folder that exists (any format; default: stdout)")
    export.add_argument("--model-dir", default=None,
                        help="vllm / sglang / compose: the target directory the server loads (default: the embedded "
                             "default's served copy under $SPECDEC_HOME/models once the engine check "
                             "wrote it, else the target id)")
    common(export, url=True)
    export.set_defaults(func=Command("tasks.cli.config:cmd_export"))
