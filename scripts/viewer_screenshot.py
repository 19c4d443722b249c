"""Reproduce docs/viewer.png: the latent-reasoning viewer (``/viewer/``) with the trained CoLaR
model thinking about a 4x4 multiplication, side by side with the text chain-of-thought model
on the same question.

Serves ``--model`` and ``--compare`` from one server on the CPU (each loads in about 30 s),
opens the page in headless chromium, asks question ``--line`` of the shared 4x4 test set at
compression factor 2 with its expected answer, waits for both runs and saves a PNG (a
palette PNG when Pillow is installed, to stay small).

    python scripts/viewer_screenshot.py [--out docs/viewer.png] [--line 0]
        [--compare models/smollm2-mult-cot | --compare ""  (thinking off)]
"""

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def question(path: Path, line: int) -> tuple[str, str]:
    """``(question, expected answer)`` of a ``a * b||steps #### answer`` line."""
    text = path.read_text().splitlines()[line]
    q, rest = text.split("||")
    return q.strip(), rest.split("####")[1].strip()


def shrink(path: Path) -> None:
    """Quantize the PNG to a 256-colour palette (text and flat colours survive it)."""
    try:
        from PIL import Image
    except ImportError:
        return
    img = Image.open(path).convert("RGB")
    img.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models/smollm2-mult-colar"))
    ap.add_argument("--compare", default=str(ROOT / "models/smollm2-mult-cot"),
                    help='a second served model shown side by side; "" for thinking off')
    ap.add_argument("--data", default=os.path.join(
        os.environ.get("LATENTSERVE_DATA", "/work/shared/data"), "multiplication",
        "4x4_test.txt"))
    ap.add_argument("--line", type=int, default=0)
    ap.add_argument("--compression-factor", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "docs/viewer.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    q, expected = question(Path(args.data), args.line)
    models = [args.model] + ([args.compare] if args.compare else [])
    # served by directory name: the picture shows no checkout path
    names = [Path(m).name for m in models]
    srv = start_server([EngineConfig(model=m, device="cpu", served_model_name=n)
                        for m, n in zip(models, names)], timeout=600)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{srv.base_url}/viewer/")
            page.wait_for_selector(f'#model option[value="{names[0]}"]', state="attached")
            page.select_option("#model", names[0])
            page.fill("#prompt", q)
            page.fill("#expected", expected)
            page.fill("#max_tokens", "160")
            page.fill("#c_compression_factor", str(args.compression_factor))
            page.check("#compare")
            page.select_option("#compare_with", names[1] if args.compare else "")
            page.click("#run")
            runs = 2
            page.wait_for_selector(f".run:nth-child({runs}) table.summary tr", timeout=600_000)
            page.screenshot(path=args.out, full_page=True)
            print(page.inner_text("#runs"))
            browser.close()
    finally:
        srv.stop()
    shrink(Path(args.out))
    print(f"{args.out}: {Path(args.out).stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
