use super::*;

fn timings(prompt_n: usize, predicted_n: usize) -> engine::Timings {
    engine::Timings {
        prompt_n,
        prompt_ms: 100.0,
        predicted_n,
        predicted_ms: 200.0,
        cache_n: 3,
        experts: None,
        ..Default::default()
    }
}

#[test]
fn lifecycle_updates_queue_current_and_totals() {
    let s = Stats::new();
    s.request_queued(1, "chat");
    s.request_queued(2, "messages");
    assert_eq!(s.queue_depth(), 2);
    s.request_started(1, 10);
    assert_eq!(s.queue_depth(), 1);
    s.prompt_progress(1, 10);
    s.token_generated(1);
    s.token_generated(1);
    let snap = s.snapshot();
    assert_eq!(snap["state"], "decoding");
    assert_eq!(snap["current"]["predicted_n"], 2);
    assert_eq!(snap["current"]["n_ctx_used"], 12);
    assert_eq!(snap["totals"]["tokens_predicted"], 2);
    assert_eq!(snap["queue"]["depth"], 1);
    s.request_finished(1, &timings(10, 2), "stop", 12);
    s.request_failed(2, "boom");
    let snap = s.snapshot();
    assert_eq!(snap["state"], "idle");
    assert_eq!(snap["queue"]["depth"], 0);
    assert_eq!(snap["totals"]["requests"], 2);
    assert_eq!(snap["totals"]["errors"], 1);
    assert_eq!(snap["totals"]["tokens_predicted"], 2);
    assert_eq!(snap["requests"][0]["id"], 2);
    assert_eq!(snap["requests"][0]["error"], "boom");
    assert_eq!(snap["requests"][1]["route"], "chat");
    assert_eq!(snap["requests"][1]["timings"]["predicted_per_second"], 10.0);
}

#[test]
fn prometheus_text_has_help_type_and_values() {
    let s = Stats::new();
    s.request_queued(7, "chat");
    s.request_started(7, 4);
    s.token_generated(7);
    s.request_finished(7, &timings(4, 1), "length", 5);
    let text = s.render_prometheus(100);
    assert!(text.contains("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 4\n"));
    assert!(text.contains("llamacpp:kv_cache_usage_ratio 0.05\n"));
    assert!(text.contains("scoria:requests_total{route=\"chat\",finish=\"length\"} 1\n"));
    assert!(text.contains("scoria:prompt_tokens_cached_total 3\n"));
    assert!(text.contains("llamacpp:prompt_tokens_seconds 40\n"));
    // The throughput window resets on each scrape.
    let again = s.render_prometheus(100);
    assert!(again.contains("llamacpp:prompt_tokens_seconds 0\n"));
    // Every sample line belongs to a declared metric.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        assert!(text.contains(&format!("# TYPE {name} ")), "{line}");
    }
}

#[test]
fn draft_and_expert_numbers_appear_when_reported() {
    let s = Stats::new();
    assert!(s.snapshot()["draft"].is_null());
    s.draft_checked(1, 10, 7);
    s.set_expert_tiers(json!({"vram": {"hit_rate": 0.5}}));
    let snap = s.snapshot();
    assert_eq!(snap["draft"]["accept_rate"], 0.7);
    assert_eq!(snap["experts"]["tiers"]["vram"]["hit_rate"], 0.5);
    assert!(s
        .render_prometheus(10)
        .contains("scoria:draft_tokens_accepted_total 7\n"));
}

#[test]
fn a_finished_request_s_drafts_count_in_the_totals() {
    let s = Stats::new();
    s.request_queued(4, "chat");
    s.request_started(4, 5);
    let t = engine::Timings {
        draft_n: 12,
        draft_n_accepted: 9,
        ..timings(5, 20)
    };
    s.request_finished(4, &t, "stop", 25);
    let snap = s.snapshot();
    assert_eq!(snap["draft"]["proposed"], 12);
    assert_eq!(snap["draft"]["accepted"], 9);
    let text = s.render_prometheus(10);
    assert!(text.contains("scoria:draft_tokens_total 12\n"), "{text}");
    assert!(text.contains("scoria:draft_tokens_accepted_total 9\n"));
}

#[test]
fn cancelled_requests_keep_their_work_and_are_not_errors() {
    let s = Stats::new();
    s.request_queued(3, "chat");
    s.request_started(3, 5);
    s.prompt_progress(3, 5);
    s.token_generated(3);
    s.token_generated(3);
    s.request_failed(3, "cancelled: the client disconnected");
    let snap = s.snapshot();
    assert_eq!(snap["totals"]["errors"], 0);
    assert_eq!(snap["totals"]["tokens_predicted"], 2);
    assert_eq!(snap["totals"]["prompt_tokens"], 5);
    assert_eq!(snap["requests"][0]["finish"], "cancelled");
    assert_eq!(snap["requests"][0]["n_ctx_used"], 7);
    s.request_queued(4, "chat");
    s.request_failed(4, "prompt too long");
    assert_eq!(s.snapshot()["totals"]["errors"], 1);
    let text = s.render_prometheus(10);
    assert!(text.contains("finish=\"cancelled\"} 1"));
    assert!(text.contains("finish=\"error\"} 1"));
}

#[test]
fn tiered_expert_counters_reach_metrics_and_the_snapshot() {
    let s = Stats::new();
    assert!(!s.render_prometheus(10).contains("scoria:expert"));
    s.set_expert_stats(&engine::experts::TierStats {
        hits: 60,
        ram_misses: 20,
        ram_bytes: 2000,
        disk_misses: 5,
        disk_bytes: 500,
        cpu_misses: 15,
        cpu_bytes: 1500,
        disk_ns: 3_000_000,
        step_ns: 9_000_000,
        wait_ns: 4_000_000,
        cpu_ns: 2_000_000,
        prefetched: 7,
        prefetch_unused: 1,
    });
    let text = s.render_prometheus(10);
    assert!(
        text.contains("# TYPE scoria:expert_uses_total counter\n"),
        "{text}"
    );
    assert!(
        text.contains("scoria:expert_uses_total{tier=\"vram\"} 60\n"),
        "{text}"
    );
    assert!(
        text.contains("scoria:expert_uses_total{tier=\"cpu\"} 15\n"),
        "{text}"
    );
    assert!(
        text.contains("scoria:expert_miss_bytes_total{tier=\"disk\"} 500\n"),
        "{text}"
    );
    assert!(
        !text.contains("expert_miss_bytes_total{tier=\"vram\"}"),
        "{text}"
    );
    assert!(
        text.contains("scoria:expert_prefetched_total{tier=\"ram\"} 7\n"),
        "{text}"
    );
    let snap = s.snapshot();
    assert_eq!(snap["experts"]["tiers"]["vram"]["hit_rate"], 0.6);
    assert_eq!(snap["experts"]["tiers"]["ram"]["prefetch_unused"], 1);
    assert_eq!(snap["experts"]["tiers"]["disk"]["read_ms"], 3.0);
    assert_eq!(snap["experts"]["tiers"]["cpu"]["compute_ms"], 2.0);
}

#[test]
fn device_memory_is_exported_when_known() {
    let s = Stats::new();
    assert!(s.snapshot()["device"].is_null());
    assert!(!s.render_prometheus(10).contains("scoria:device"));
    s.set_device(engine::DeviceReport {
        device: engine::Device::Cpu,
        name: "cpu (avx2)".into(),
        vram_used: None,
        vram_total: None,
    });
    let text = s.render_prometheus(10);
    assert!(!text.contains("scoria:device_memory"), "{text}");
    assert!(text.contains("scoria:device_info{device=\"cpu\",name=\"cpu (avx2)\"} 1\n"));
    s.set_device(engine::DeviceReport {
        device: engine::Device::Cuda(0),
        name: "NVIDIA \"H200\"".into(),
        vram_used: Some(21_000_000_000),
        vram_total: Some(150_000_000_000),
    });
    let text = s.render_prometheus(10);
    assert!(text.contains("# TYPE scoria:device_memory_used_bytes gauge\nscoria:device_memory_used_bytes 21000000000\n"), "{text}");
    assert!(text.contains("scoria:device_memory_total_bytes 150000000000\n"));
    assert!(text.contains("name=\"NVIDIA \\\"H200\\\"\"} 1"), "{text}");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        assert!(text.contains(&format!("# TYPE {name} ")), "{line}");
    }
    let snap = s.snapshot();
    assert_eq!(snap["device"]["device"], "cuda:0");
    assert_eq!(snap["device"]["vram_used_bytes"], 21_000_000_000u64);
    assert_eq!(s.device().map(|d| d.device), Some(engine::Device::Cuda(0)));
}

#[test]
fn unknown_ids_are_harmless() {
    let s = Stats::new();
    s.prompt_progress(9, 3);
    s.token_generated(9);
    s.request_finished(9, &timings(1, 1), "stop", 2);
    assert_eq!(s.snapshot()["totals"]["requests"], 1);
}

#[test]
fn interleaved_requests_are_tracked_apart() {
    let s = Stats::new();
    s.request_queued(1, "chat");
    s.request_queued(2, "messages");
    s.request_queued(3, "chat");
    s.request_started(1, 10);
    s.request_started(2, 4);
    assert_eq!(s.queue_depth(), 1);
    assert_eq!(s.live_count(), 2);
    assert!(s.busy());
    // Steps interleave the two: prompt chunks, then one token each per step.
    s.prompt_progress(1, 6);
    s.prompt_progress(2, 4);
    s.token_generated(2);
    s.prompt_progress(1, 10);
    s.token_generated(1);
    s.token_generated(2);
    let snap = s.snapshot();
    let live = snap["live"].as_array().cloned().unwrap_or_default();
    assert_eq!(live.len(), 2, "{snap}");
    assert_eq!(live[0]["id"], 1);
    assert_eq!(live[0]["prompt_done"], 10);
    assert_eq!(live[0]["predicted_n"], 1);
    assert_eq!(live[1]["id"], 2);
    assert_eq!(live[1]["predicted_n"], 2);
    assert_eq!(live[1]["n_ctx_used"], 6);
    // `current` is the oldest live request.
    assert_eq!(snap["current"]["id"], 1);
    assert_eq!(snap["totals"]["tokens_predicted"], 3);
    assert_eq!(snap["totals"]["prompt_tokens"], 14);
    assert_eq!(snap["queue"]["depth"], 1);

    // The first ends; the second stays live with its own counts.
    s.request_finished(1, &timings(10, 1), "stop", 11);
    let snap = s.snapshot();
    assert_eq!(snap["current"]["id"], 2);
    assert_eq!(snap["current"]["predicted_n"], 2);
    assert_eq!(snap["live"].as_array().map(Vec::len), Some(1));
    assert_eq!(snap["state"], "decoding");
    assert_eq!(snap["totals"]["requests"], 1);
    // Finished: its timings; live: its counts so far.
    assert_eq!(snap["totals"]["tokens_predicted"], 1 + 2);
    assert_eq!(snap["totals"]["prompt_tokens"], 10 + 4);

    // The third starts while the second runs, and fails; the second is untouched.
    s.request_started(3, 5);
    s.prompt_progress(3, 2);
    s.request_failed(3, "boom");
    s.token_generated(2);
    let snap = s.snapshot();
    assert_eq!(snap["current"]["id"], 2);
    assert_eq!(snap["current"]["predicted_n"], 3);
    assert_eq!(snap["queue"]["depth"], 0);
    assert_eq!(snap["totals"]["errors"], 1);
    assert_eq!(snap["requests"][0]["id"], 3);
    assert_eq!(snap["requests"][0]["timings"]["prompt_n"], 2);
    s.request_finished(2, &timings(4, 3), "length", 7);
    let snap = s.snapshot();
    assert_eq!(snap["state"], "idle");
    assert!(!s.busy());
    assert_eq!(snap["totals"]["requests"], 3);
    assert_eq!(snap["totals"]["tokens_predicted"], 1 + 3);
    assert_eq!(snap["totals"]["prompt_tokens"], 10 + 2 + 4);
    let ids: Vec<u64> = snap["requests"]
        .as_array()
        .map(|a| a.iter().filter_map(|e| e["id"].as_u64()).collect())
        .unwrap_or_default();
    assert_eq!(ids, vec![2, 3, 1], "newest first");
    assert_eq!(snap["requests"][0]["route"], "messages");
}

#[test]
fn live_requests_keep_arrival_order_whatever_the_start_order() {
    let s = Stats::new();
    s.request_queued(1, "chat");
    std::thread::sleep(std::time::Duration::from_millis(2));
    s.request_queued(2, "chat");
    s.request_started(2, 3);
    s.request_started(1, 3);
    let snap = s.snapshot();
    assert_eq!(snap["live"][0]["id"], 1, "{snap}");
    assert_eq!(snap["live"][1]["id"], 2);
    assert_eq!(snap["current"]["id"], 1);
}

#[test]
fn decode_calls_count_engine_steps_once_reported() {
    let s = Stats::new();
    // A one-request worker that never reports steps: each chunk and token is a call.
    s.request_started(1, 4);
    s.prompt_progress(1, 4);
    s.token_generated(1);
    assert_eq!(s.snapshot()["totals"]["n_decode"], 2);
    // A worker that reports steps: only the steps count, with their busy slots.
    s.request_started(2, 4);
    s.engine_step(2);
    s.token_generated(1);
    s.token_generated(2);
    s.engine_step(2);
    s.token_generated(1);
    s.prompt_progress(2, 4);
    let t = s.snapshot()["totals"].clone();
    assert_eq!(t["n_decode"], 4, "{t}");
    assert_eq!(t["n_busy_slots"], 2 + 4);
    assert_eq!(t["busy_slots_per_decode"], 1.5);
    let text = s.render_prometheus(100);
    assert!(text.contains("llamacpp:n_decode_total 4\n"), "{text}");
    assert!(
        text.contains("llamacpp:n_busy_slots_per_decode 1.5\n"),
        "{text}"
    );
}

fn slot(id: usize, cached_tokens: usize, request: Option<u64>) -> SlotView {
    SlotView {
        id,
        busy: request.is_some(),
        cached_tokens,
        request,
    }
}

#[test]
fn slots_and_pool_drive_slots_metrics_and_the_snapshot() {
    let s = Stats::new();
    // Before the worker says anything: one slot, as the one-request server had.
    assert_eq!(s.total_slots(), 1);
    let one = s.slots_json(1000);
    assert_eq!(one.len(), 1);
    assert_eq!(one[0]["n_ctx"], 1000);
    assert_eq!(one[0]["id_task"], -1);
    assert_eq!(one[0]["state"], "idle");

    s.set_pool(100, 4, 400);
    assert_eq!(s.total_slots(), 4);
    assert_eq!(s.ctx_per_slot(1000), 100);
    s.request_queued(7, "chat");
    s.request_queued(8, "chat");
    s.request_queued(9, "chat");
    s.request_started(7, 10);
    s.request_started(8, 20);
    s.prompt_progress(7, 10);
    s.token_generated(7);
    s.prompt_progress(8, 5);
    // The engine: 7 in slot 2 (which reused 4 positions), 8 in slot 0, slot 1
    // keeps 30 positions of an earlier request, slot 3 is empty.
    s.set_slots(vec![
        slot(0, 0, Some(8)),
        slot(1, 30, None),
        slot(2, 4, Some(7)),
        slot(3, 0, None),
    ]);
    let slots = s.slots_json(1000);
    assert_eq!(slots.len(), 4);
    assert_eq!(slots[0]["id_task"], 8);
    assert_eq!(slots[0]["state"], "prompt");
    assert_eq!(slots[0]["n_prompt_tokens"], 20);
    assert_eq!(slots[0]["n_prompt_tokens_processed"], 5);
    assert_eq!(slots[0]["n_ctx"], 100);
    assert_eq!(slots[1]["is_processing"], false);
    assert_eq!(slots[1]["id_task"], -1);
    assert_eq!(slots[1]["n_ctx_used"], 30);
    assert_eq!(slots[1]["cached_tokens"], 30);
    assert_eq!(slots[2]["id_task"], 7);
    assert_eq!(slots[2]["state"], "decoding");
    assert_eq!(slots[2]["n_decoded"], 1);
    assert_eq!(slots[2]["n_ctx_used"], 11);
    assert_eq!(slots[2]["cached_tokens"], 4);
    assert_eq!(slots[3]["n_ctx_used"], 0);

    let snap = s.snapshot();
    assert_eq!(snap["live"][0]["slot"], 2, "{snap}");
    assert_eq!(snap["live"][1]["slot"], 0);
    assert_eq!(snap["slots"].as_array().map(Vec::len), Some(4));
    assert_eq!(snap["context"]["used"], 5 + 30 + 11);
    assert_eq!(snap["context"]["slots"], 4);
    assert_eq!(snap["context"]["busy_slots"], 2);
    assert_eq!(snap["context"]["per_slot"], 100);

    let text = s.render_prometheus(1000);
    assert!(text.contains("llamacpp:requests_processing 2\n"), "{text}");
    assert!(text.contains("llamacpp:requests_deferred 1\n"), "{text}");
    assert!(text.contains("llamacpp:kv_cache_tokens 46\n"), "{text}");
    assert!(
        text.contains("llamacpp:kv_cache_usage_ratio 0.115\n"),
        "{text}"
    );
    assert!(text.contains("scoria:slots_total 4\n"), "{text}");
    assert!(text.contains("scoria:slots_busy 2\n"), "{text}");
    assert!(text.contains("scoria:context_size 100\n"), "{text}");
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name = line.split(['{', ' ']).next().unwrap_or("");
        assert!(text.contains(&format!("# TYPE {name} ")), "{line}");
    }
}

#[test]
fn a_pool_without_a_slot_list_fills_slots_in_arrival_order() {
    let s = Stats::new();
    // The slots share one pool of 50 positions.
    s.set_pool(50, 3, 50);
    s.request_started(1, 4);
    s.request_started(2, 6);
    s.prompt_progress(2, 6);
    let slots = s.slots_json(0);
    assert_eq!(slots.len(), 3);
    assert_eq!(slots[0]["id_task"], 1);
    assert_eq!(slots[1]["id_task"], 2);
    assert_eq!(slots[1]["n_ctx_used"], 6);
    assert_eq!(slots[2]["is_processing"], false);
    let text = s.render_prometheus(0);
    assert!(
        text.contains("llamacpp:kv_cache_usage_ratio 0.12\n"),
        "{text}"
    );
    let snap = s.snapshot();
    assert_eq!(snap["live"][1]["slot"], 1);
    assert_eq!(snap["context"]["total"], 50);
    assert_eq!(snap["context"]["per_slot"], 50);
    assert_eq!(s.ctx_total(0), 50);
}

#[test]
fn requests_sit_in_the_slot_they_took() {
    let s = Stats::new();
    s.set_pool(64, 4, 64);
    s.request_started(1, 4);
    s.request_slot(1, 3);
    s.request_started(2, 8);
    s.request_slot(2, 1);
    s.token_generated(1);
    // No slot list yet: each in the slot it took.
    let slots = s.slots_json(0);
    assert_eq!(slots[3]["id_task"], 1, "{slots:?}");
    assert_eq!(slots[1]["id_task"], 2);
    assert_eq!(slots[0]["is_processing"], false);
    assert_eq!(s.snapshot()["live"][0]["slot"], 3);
    // The engine's list names no request: busy slots link by the slot taken,
    // and the engine's count of the slot's tokens wins when larger.
    s.set_slots(vec![
        SlotView {
            id: 0,
            busy: false,
            cached_tokens: 9,
            request: None,
        },
        SlotView {
            id: 1,
            busy: true,
            cached_tokens: 6,
            request: None,
        },
        SlotView {
            id: 2,
            busy: false,
            cached_tokens: 0,
            request: None,
        },
        SlotView {
            id: 3,
            busy: true,
            cached_tokens: 5,
            request: None,
        },
    ]);
    let slots = s.slots_json(0);
    assert_eq!(slots[1]["id_task"], 2);
    assert_eq!(slots[1]["state"], "prompt");
    assert_eq!(slots[1]["n_ctx_used"], 6);
    assert_eq!(slots[3]["id_task"], 1);
    assert_eq!(slots[3]["n_decoded"], 1);
    assert_eq!(slots[0]["n_ctx_used"], 9);
    let snap = s.snapshot();
    assert_eq!(snap["live"][1]["slot"], 1);
    assert_eq!(snap["context"]["used"], 9 + 6 + 5);
    // A busy slot whose request is not live (finished since the list came).
    s.request_finished(2, &timings(8, 0), "stop", 8);
    let slots = s.slots_json(0);
    assert_eq!(slots[1]["is_processing"], true);
    assert_eq!(slots[1]["id_task"], -1);
    assert_eq!(slots[1]["state"], "processing");
}

#[test]
fn a_request_admitted_since_the_engines_last_slot_list_shows_as_processing() {
    // The list comes after each engine step; a request the engine took after
    // it was made must not leave `/slots` saying idle (clients poll `/slots`
    // to know the server is done with their request).
    let s = Stats::new();
    s.set_pool(100, 2, 200);
    s.set_slots(vec![slot(0, 12, None), slot(1, 0, None)]);
    s.request_queued(5, "messages");
    assert_eq!(s.queue_depth(), 1);
    // Started, before it said which slot it took: shown in a free slot.
    s.request_started(5, 30);
    assert_eq!(s.queue_depth(), 0);
    let slots = s.slots_json(0);
    assert!(
        slots.iter().any(|x| x["is_processing"] == true),
        "{slots:?}"
    );
    assert_eq!(slots[0]["id_task"], 5, "{slots:?}");
    // It took slot 1; the list still says slot 1 is idle.
    s.request_slot(5, 1);
    let slots = s.slots_json(0);
    assert_eq!(slots[0]["is_processing"], false, "{slots:?}");
    assert_eq!(slots[0]["n_ctx_used"], 12);
    assert_eq!(slots[1]["is_processing"], true, "{slots:?}");
    assert_eq!(slots[1]["id_task"], 5);
    assert_eq!(slots[1]["n_prompt_tokens"], 30);
    // Finished: idle everywhere.
    s.request_finished(5, &timings(30, 3), "stop", 33);
    let slots = s.slots_json(0);
    assert!(
        slots.iter().all(|x| x["is_processing"] == false),
        "{slots:?}"
    );
}

#[test]
fn a_warning_stands_beside_ok_health_until_it_clears() {
    let s = Stats::new();
    let gauge = |s: &Stats| {
        s.render_prometheus(256)
            .lines()
            .find_map(|l| l.strip_prefix("scoria:warning ")?.parse::<f64>().ok())
            .expect("scoria:warning")
    };
    assert!(s.warning().is_none());
    assert_eq!(gauge(&s), 0.0);
    s.set_warning(Some("VRAM pressure: cuda:0: ...".into()));
    assert_eq!(s.warning().as_deref(), Some("VRAM pressure: cuda:0: ..."));
    assert_eq!(gauge(&s), 1.0);
    assert!(
        s.fault().is_none() && s.fatal().is_none(),
        "a warning is neither a fault nor a failure"
    );
    s.set_warning(None);
    assert!(s.warning().is_none());
    assert_eq!(gauge(&s), 0.0);
}
