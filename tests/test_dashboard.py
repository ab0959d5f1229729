"""The dashboard of ``eventlight serve``: its JSON routes and page (always), and the page in headless
Chromium (``playwright`` driving the system's ``chromium``; skipped when there is none)."""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import eventlight as agl
from eventlight.net import free_port
from eventlight.server.app import create_app

PROMPT_V1 = {"prompt_template": agl.PromptTemplate(template="v1 {q}")}
PROMPT_V2 = {"prompt_template": agl.PromptTemplate(template="v2 {q}")}


def reward_span(rid: str, aid: str, reward: float, parent: str | None = None) -> agl.Span:
    attributes = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": reward}
    return agl.Span.from_attributes(
        attributes=attributes, rollout_id=rid, attempt_id=aid, name="agentlightning.annotation", parent_id=parent
    )


async def finished(store: Any, resources_id: str, rewards: list[float], mode: str = "train") -> list[str]:
    """Rollouts that ran and succeeded with ``rewards``: each a root span, an LLM call under it, and
    its reward under that."""
    ids = []
    for reward in rewards:
        ro = await store.start_rollout({"q": reward}, mode=mode, resources_id=resources_id, worker_id="w-done")
        rid, aid = ro.rollout_id, ro.attempt.attempt_id
        root = agl.Span.from_attributes(
            attributes={"agent.step": "solve"}, rollout_id=rid, attempt_id=aid, name="agent.run", start_time=time.time()
        )
        call = agl.Span.from_attributes(
            attributes={"gen_ai.request.model": "m-1", "gen_ai.usage.prompt_tokens": 9},
            rollout_id=rid,
            attempt_id=aid,
            name="openai.chat.completion",
            parent_id=root.span_id,
        )
        await store.add_many_spans([root, call, reward_span(rid, aid, reward, parent=call.span_id)])
        await store.update_attempt(rid, aid, status="succeeded")
        ids.append(rid)
    return ids


async def fill(store: Any) -> dict[str, Any]:
    """Two resources snapshots with rewards, a failed-then-retried rollout, two waiting, a worker."""
    v1 = await store.add_resources(PROMPT_V1)
    low = await finished(store, v1.resources_id, [0.2, 0.4])
    v2 = await store.add_resources(PROMPT_V2)
    high = await finished(store, v2.resources_id, [0.8, 1.0])
    retried = await store.enqueue_rollout(
        {"q": "retry"},
        resources_id=v2.resources_id,
        config=agl.RolloutConfig(max_attempts=2, retry_condition=["failed"]),
    )
    first = await store.dequeue_rollout(worker_id="w-1")
    await store.update_attempt(first.rollout_id, first.attempt.attempt_id, status="failed")
    second = await store.dequeue_rollout(worker_id="w-1")
    assert second.rollout_id == retried.rollout_id and second.attempt.sequence_id == 2
    waiting = [(await store.enqueue_rollout({"q": i})).rollout_id for i in range(2)]
    await store.update_worker("w-1", {"cpu": 0.3})
    if hasattr(store, "sync_all"):
        await store.sync_all()
    return {"v1": v1, "v2": v2, "low": low, "high": high, "retried": retried.rollout_id, "waiting": waiting}


async def test_json_routes_and_page(store: Any) -> None:
    """On both backends (the SQL views on JetStream, the store's queries in memory)."""
    made = await fill(store)
    transport = httpx.ASGITransport(app=create_app(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://dash") as http:
        page = await http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for element in ('id="rollouts"', 'id="timeline"', 'id="spans"', 'id="reward-chart"', 'id="workers"'):
            assert element in page.text
        assert "<script" in page.text and 'src="http' not in page.text  # no build step, nothing fetched from afar

        summary = (await http.get("/dashboard/api/summary")).json()
        assert summary["queue_depth"] == 2 and summary["projector_lag"] == 0
        assert summary["rollouts_by_status"]["succeeded"] == 4 and summary["rollouts_by_status"]["queuing"] == 2
        assert summary["attempts_by_status"]["failed"] == 1
        assert summary["workers"][0]["worker_id"] == "w-1" and summary["workers"][0]["alive"] is True

        every = (await http.get("/dashboard/api/rollouts")).json()
        assert every["total"] == 7
        starts = [r["start_time"] for r in every["items"]]
        assert starts == sorted(starts, reverse=True)  # newest first
        queued = (await http.get("/dashboard/api/rollouts", params={"status": "queuing"})).json()
        assert sorted(r["rollout_id"] for r in queued["items"]) == sorted(made["waiting"])
        both = (
            await http.get("/dashboard/api/rollouts", params=[("status", "queuing"), ("status", "preparing")])
        ).json()
        assert both["total"] == 3
        one = made["high"][0]
        found = (await http.get("/dashboard/api/rollouts", params={"q": one[-6:]})).json()
        assert [r["rollout_id"] for r in found["items"]] == [one]
        bad = await http.get("/dashboard/api/rollouts", params={"status": "sleeping"})
        assert bad.status_code == 400 and "sleeping" in bad.json()["detail"]

        detail = (await http.get(f"/dashboard/api/rollouts/{made['retried']}/attempts")).json()
        assert [a["status"] for a in detail["attempts"]] == ["failed", "preparing"]
        assert detail["rollout"]["rollout_id"] == made["retried"]
        assert (await http.get("/dashboard/api/rollouts/ro-000000000000/attempts")).status_code == 404

        attempt = (await http.get(f"/dashboard/api/rollouts/{one}/attempts")).json()["attempts"][0]["attempt_id"]
        spans = (await http.get(f"/dashboard/api/rollouts/{one}/attempts/{attempt}/spans")).json()
        by_name = {s["name"]: s for s in spans}
        assert by_name["agent.run"]["parent_id"] is None
        assert by_name["openai.chat.completion"]["parent_id"] == by_name["agent.run"]["span_id"]
        assert by_name["agentlightning.annotation"]["attributes"]["agentlightning.reward.0.value"] == 0.8

        rewards = (await http.get("/dashboard/api/rewards")).json()
        by_id = {r["resources_id"]: r for r in rewards if r["mode"] == "train"}
        assert by_id[made["v1"].resources_id]["mean_reward"] == pytest.approx(0.3)
        assert by_id[made["v2"].resources_id]["mean_reward"] == pytest.approx(0.9)
        assert by_id[made["v2"].resources_id]["rollouts"] == 2


# -- in a browser ------------------------------------------------------------------------------


def chromium() -> str | None:
    """``$EVENTLIGHT_CHROMIUM``, else ``chromium`` / ``chromium-browser`` on ``PATH``."""
    return os.environ.get("EVENTLIGHT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@pytest.mark.skipif(chromium() is None, reason="no chromium binary (set EVENTLIGHT_CHROMIUM or install chromium)")
async def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect

    store = agl.InMemoryLightningStore()
    made = await fill(store)
    async with agl.LightningStoreServer(store, port=free_port()) as server, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(f"{server.endpoint}/dashboard")
            await expect(page.locator("#queue-depth")).to_have_text("2")
            await expect(page.locator("#projector-lag")).to_have_text("0")
            await expect(page.locator("#rollouts tbody tr")).to_have_count(7)
            await expect(page.locator("#workers tbody tr[data-worker-id='w-1'] td").nth(1)).to_have_text("yes")
            await expect(page.locator("#reward-chart rect.bar")).to_have_count(2)
            bars = {}  # resources id -> (mean reward it says, height it is drawn)
            for bar in await page.locator("#reward-chart rect.bar").all():
                mean, height = await bar.get_attribute("data-mean"), await bar.get_attribute("height")
                bars[await bar.get_attribute("data-resources-id")] = (float(mean or "nan"), float(height or 0))
            low, high = bars[made["v1"].resources_id], bars[made["v2"].resources_id]
            assert low[0] == pytest.approx(0.3) and high[0] == pytest.approx(0.9)
            assert high[1] == pytest.approx(3 * low[1], rel=0.01) and low[1] > 0  # drawn to scale
            await page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)

            # filters and search
            await page.check("#status-filter input[value=queuing]")
            await expect(page.locator("#rollouts tbody tr")).to_have_count(2)
            await expect(page.locator("#rollouts tbody tr[data-status=queuing]")).to_have_count(2)
            await page.uncheck("#status-filter input[value=queuing]")
            await page.fill("#search", made["retried"][-8:])
            await expect(page.locator("#rollouts tbody tr")).to_have_count(1)

            # a rollout's attempts on the timeline, then an attempt's span tree
            await page.click(f"#rollouts tbody tr[data-rollout-id='{made['retried']}']")
            await expect(page.locator("#timeline rect.attempt")).to_have_count(2)
            statuses = [
                await r.get_attribute("data-status") for r in await page.locator("#timeline rect.attempt").all()
            ]
            assert statuses == ["failed", "preparing"]
            await page.locator("#timeline").screenshot(path=str(tmp_path / "timeline.png"))
            await page.fill("#search", made["high"][0][-8:])
            await page.click(f"#rollouts tbody tr[data-rollout-id='{made['high'][0]}']")
            await expect(page.locator("#spans li.span")).to_have_count(3)
            root = page.locator("#spans > ul > li.span")
            await expect(root).to_have_count(1)
            await expect(root.locator("> details > summary")).to_contain_text("agent.run")
            nested = root.locator("li.span li.span")  # the reward, under the LLM call, under the root
            await expect(nested).to_have_count(1)
            await nested.locator("> details > summary").click()
            await expect(nested.locator("table.attrs")).to_contain_text("agentlightning.reward.0.value")
            await expect(nested.locator("table.attrs")).to_contain_text("0.8")
            await page.locator("#rollout-detail").screenshot(path=str(tmp_path / "spans.png"))

            # live: the page follows the store without a reload
            await page.fill("#search", "")
            await store.enqueue_rollout({"q": "late"})
            await expect(page.locator("#queue-depth")).to_have_text("3", timeout=10_000)
            await expect(page.locator("#rollouts tbody tr")).to_have_count(8, timeout=10_000)
            await page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
            assert errors == []
        finally:
            await browser.close()
    for name in ("overview", "timeline", "spans", "live"):
        width, height = png_size(tmp_path / f"{name}.png")
        assert width >= 300 and height >= 40, (name, width, height)
    print(f"\nscreenshots in {tmp_path}")
