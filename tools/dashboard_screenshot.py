"""Run the dashboard headless for a few seconds and save what it shows as SVG and PNG.

    python tools/dashboard_screenshot.py --url http://127.0.0.1:7711 --ask "Why is the sky blue?" -o docs/dashboard.png
    python tools/dashboard_screenshot.py --scripted -o docs/dashboard-scripted.png
    python tools/dashboard_screenshot.py --scripted batching -o docs/dashboard-batching.png

The PNG comes from `rsvg-convert` (Debian package librsvg2-bin).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dashboard import scenes  # noqa: E402
from dashboard.app import DashboardApp  # noqa: E402
from dashboard.messages import PromptSubmitted  # noqa: E402
from dashboard.source import HttpAsker, ScriptedAsker, ScriptedSource, WebSocketSource  # noqa: E402


def make_app(args: argparse.Namespace) -> DashboardApp:
    if args.scripted == "batching":
        records = scenes.batching()
        return DashboardApp(ScriptedSource(records, [0.02] * len(records), hold=True), ScriptedAsker(["(scripted)"]))
    if args.scripted:
        records = scenes.generating(len(scenes.ANSWER))
        first = len(records) - len(scenes.ANSWER)
        delays = [0.0] * first + [0.06] * len(scenes.ANSWER)
        return DashboardApp(ScriptedSource(records, delays, hold=True), ScriptedAsker(["(scripted)"]))
    return DashboardApp(WebSocketSource(args.url), HttpAsker(args.url))


async def shoot(args: argparse.Namespace, svg: Path) -> None:
    app = make_app(args)
    async with app.run_test(headless=True, size=(args.width, args.height)) as pilot:
        await pilot.pause(0.5)
        if args.ask:
            app.main.post_message(PromptSubmitted(args.ask))
        await pilot.pause(args.seconds)
        app.save_screenshot(filename=svg.name, path=str(svg.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="the cluster's API, e.g. http://127.0.0.1:7711")
    source.add_argument("--scripted", nargs="?", const="generating", choices=("generating", "batching"),
                        help="play a scripted three-node generation, or four requests batched (batching)")
    parser.add_argument("--ask", help="a prompt to submit once the dashboard is up")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long to watch before the screenshot")
    parser.add_argument("--width", type=int, default=140)
    parser.add_argument("--height", type=int, default=44)
    parser.add_argument("-o", "--output", type=Path, default=REPO / "docs" / "dashboard.png",
                        help="the PNG to write")
    parser.add_argument("--keep-svg", action="store_true", help="keep the SVG beside the PNG")
    args = parser.parse_args(argv)
    out: Path = args.output.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    svg = out.with_suffix(".svg") if args.keep_svg else Path(tempfile.mkdtemp()) / "dashboard.svg"
    asyncio.run(shoot(args, svg))
    if shutil.which("rsvg-convert") is None:
        print(f"wrote {svg}; rsvg-convert is missing (apt-get install librsvg2-bin), no PNG", file=sys.stderr)
        return 1
    # rsvg drops the leading spaces of each text run unless told to keep them
    svg.write_text(svg.read_text().replace("<svg ", '<svg xml:space="preserve" ', 1))
    subprocess.run(["rsvg-convert", "--zoom", "1.5", "-o", str(out), str(svg)], check=True)
    print(f"wrote {out}" + (f" and {svg}" if args.keep_svg else ""))
    if not args.keep_svg:
        svg.unlink()
        svg.parent.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
