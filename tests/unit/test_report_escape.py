"""Every user-supplied string on the page is inert: a model name, a command line and a
metrics message carrying HTML and script come out as text, not markup."""
from __future__ import annotations

import dataclasses
import json
from html.parser import HTMLParser

import pytest

from planner.report import write_report
from planner.report.build import _resource
from planner.report.sample import write_sample_run
from planner.specs import preset

EVIL = '<script>alert("pwned")</script><img src=x onerror=alert(1)>"\'&$\\mathrm{x}$'
EVIL_CMD = "planner search --model '</pre><script>document.title=1</script>' --gpus 2x8xA100-40GB"


class Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts: list[str] = []
        self.handlers: list[tuple[str, str]] = []
        self.srcs: list[str] = []
        self.text: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in_script = tag == "script"
        if tag == "script":
            self.scripts.append("")
        for name, value in attrs:
            if name.startswith("on"):
                self.handlers.append((tag, name))
            if name in ("src", "href"):
                self.srcs.append(value or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data
        else:
            self.text.append(data)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = tmp_path_factory.mktemp("evil") / "run"
    model = dataclasses.replace(preset("glm-10b"), name=EVIL)
    write_sample_run(run, model=model, study_trials=0, metrics=True, command=EVIL_CMD)
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["events"] = [{"step": 3, "kind": "nan", "message": "<b onmouseover=alert(2)>boom</b>"}]
    (run / "metrics.json").write_text(json.dumps(metrics))
    return write_report(run).read_text()


def test_strings_are_text_not_markup(page: str) -> None:
    doc = Collector()
    doc.feed(page)
    assert doc.scripts == [_resource("sort.js")], "only the page's own script may be a <script>"
    assert doc.handlers == [], f"event-handler attributes on the page: {doc.handlers}"
    assert all(s.startswith(("data:image/png;base64,", "#")) for s in doc.srcs)
    text = "".join(doc.text)
    assert EVIL in text                                   # shown, verbatim, as text
    assert "<b onmouseover=alert(2)>boom</b>" in text
    assert "</pre><script>document.title=1</script>" in text


def test_escaped_forms_in_the_source(page: str) -> None:
    assert "&lt;script&gt;alert(&#34;pwned&#34;)&lt;/script&gt;" in page
    assert '<script>alert("pwned")' not in page and "<img src=x" not in page
    assert "could not be drawn" not in page                # '$' and '\\' never reach mathtext
