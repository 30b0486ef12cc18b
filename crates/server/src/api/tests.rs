//! What each API's requests become: conversations and structured-output specs.

mod conversations {
    use crate::api::anthropic::MessagesRequest;
    use crate::api::field::FromJson;
    use crate::api::openai::ChatRequest;
    use crate::api::responses::ResponsesRequest;
    use crate::error::ApiError;
    use crate::prompt::Conversation;
    use serde_json::{json, Value};

    fn openai_chat(v: Value) -> Result<Conversation, ApiError> {
        ChatRequest::from_json(v).unwrap().conversation()
    }

    fn anthropic(v: Value) -> Result<Conversation, ApiError> {
        MessagesRequest::from_json(v).unwrap().conversation()
    }

    fn responses(v: Value) -> Result<Conversation, ApiError> {
        ResponsesRequest::from_json(v).unwrap().conversation()
    }

    #[test]
    fn leading_system_text_joins_later_system_turns_stay_in_place() {
        let c = openai_chat(json!({"messages": [
            {"role": "system", "content": "S"},
            {"role": "developer", "content": "D0"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "developer", "content": "D"},
        ]}))
        .unwrap();
        assert_eq!(
            c.messages,
            vec![
                json!({"role": "system", "content": "S\n\nD0"}),
                json!({"role": "user", "content": "hi"}),
                json!({"role": "system", "content": "D"}),
            ]
        );
        assert!(c.has_later_system());
        // Folded, for templates that take a system message only first.
        assert_eq!(
            c.folded(),
            vec![
                json!({"role": "system", "content": "S\n\nD0\n\nD"}),
                json!({"role": "user", "content": "hi"}),
            ]
        );
    }

    #[test]
    fn anthropic_accepts_a_system_message_inside_messages() {
        // Claude Code's mid-conversation system message, as messages[1].
        let c = anthropic(json!({
            "system": "Base.",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": [{"type": "text", "text": "Agents: a, b"}]},
                {"role": "user", "content": "go"},
            ],
        }))
        .unwrap();
        assert_eq!(
            c.messages[2],
            json!({"role": "system", "content": "Agents: a, b"})
        );
        assert_eq!(
            c.folded()[0],
            json!({"role": "system", "content": "Base.\n\nAgents: a, b"})
        );
        // Before any turn it simply joins the system prompt.
        let c = anthropic(json!({"messages": [
            {"role": "system", "content": "First."},
            {"role": "user", "content": "hi"}]}))
        .unwrap();
        assert_eq!(
            c.messages[0],
            json!({"role": "system", "content": "First."})
        );
        assert!(!c.has_later_system());
    }

    #[test]
    fn assistant_tool_call_arguments_become_objects() {
        let c = openai_chat(json!({"messages": [
            {"role": "user", "content": "w?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}))
        .unwrap();
        assert_eq!(
            c.messages[1]["tool_calls"][0]["function"]["arguments"]["x"],
            1
        );
        assert_eq!(c.messages[2]["role"], "tool");
        assert!(c.tools.is_some());
    }

    #[test]
    fn bad_messages_name_the_field() {
        let e = openai_chat(json!({"messages": [{"role": "wizard", "content": "x"}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = openai_chat(json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}]}]}))
        .unwrap_err();
        assert!(e.message.contains("messages[0].content[0]"));
        assert!(openai_chat(json!({}))
            .unwrap_err()
            .message
            .contains("messages"));
    }

    #[test]
    fn anthropic_blocks() {
        let c = anthropic(json!({
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "cold"}]},
                    {"type": "text", "text": "thanks"}]},
            ],
            "tools": [{"name": "get", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}],
        }))
        .unwrap();
        assert_eq!(c.messages[0]["content"], "Be brief.");
        assert_eq!(c.messages[2]["reasoning_content"], "hmm");
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"]["city"],
            "Oslo"
        );
        assert_eq!(
            c.messages[3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "cold"})
        );
        assert_eq!(c.messages[4]["content"], "thanks");
        assert_eq!(c.tools.as_ref().unwrap().as_array().unwrap().len(), 1);
    }

    #[test]
    fn responses_items_round_trip() {
        let c = responses(json!({
            "instructions": "I",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "go"}]},
                {"type": "reasoning", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{\"cmd\":\"ls\"}"},
                {"type": "function_call", "call_id": "c2", "name": "sh", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            ],
            "tools": [{"type": "function", "name": "sh", "parameters": {"type": "object"}},
                      {"type": "web_search"},
                      {"type": "namespace", "tools": [{"type": "function", "name": "inner"}]}],
        }))
        .unwrap();
        assert_eq!(c.messages[0]["content"], "I\n\nD");
        assert_eq!(c.messages[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"]["cmd"],
            "ls"
        );
        assert_eq!(c.messages[3]["role"], "tool");
        assert_eq!(c.tools.as_ref().unwrap().as_array().unwrap().len(), 2);
    }
}

mod structured {
    use crate::api::anthropic::MessagesRequest;
    use crate::api::field::FromJson;
    use crate::api::openai::{ChatRequest, CompletionRequest};
    use crate::api::responses::ResponsesRequest;
    use serde_json::{json, Value};

    fn chat(v: Value) -> ChatRequest {
        ChatRequest::from_json(v).unwrap()
    }

    fn completion(v: Value) -> CompletionRequest {
        CompletionRequest::from_json(v).unwrap()
    }

    fn responses(v: Value) -> ResponsesRequest {
        ResponsesRequest::from_json(v).unwrap()
    }

    fn anthropic(v: Value) -> MessagesRequest {
        MessagesRequest::from_json(v).unwrap()
    }

    #[test]
    fn formats_are_read_where_each_api_puts_them() {
        let c = chat(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}),
        );
        let s = c.structured(None).unwrap().unwrap();
        assert_eq!(s.json.unwrap().field, "response_format.json_schema.schema");
        let r = responses(
            json!({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "array"}}}}),
        );
        let s = r.structured(None).unwrap().unwrap();
        assert_eq!(s.json.unwrap().schema, json!({"type": "array"}));
        let o = completion(json!({"response_format": {"type": "json_object"}}));
        assert!(o.structured().unwrap().is_some());
        assert!(completion(json!({"response_format": {"type": "text"}}))
            .structured()
            .unwrap()
            .is_none());
        let e = chat(json!({"response_format": {"type": "yaml"}}))
            .structured(None)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.type"));
    }

    #[test]
    fn tool_choices() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}
        ]);
        let s = chat(json!({"tool_choice": "required"}))
            .structured(Some(&tools))
            .unwrap()
            .unwrap();
        assert!(s.force_tools && s.tools.len() == 2 && !s.single_call);
        let s = chat(json!({"tool_choice": {"type": "function", "function": {"name": "b"}}, "parallel_tool_calls": false}))
            .structured(Some(&tools))
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.tools.len(), s.tools[0].name.as_str(), s.single_call),
            (1, "b", true)
        );
        let e = chat(json!({"tool_choice": {"type": "function", "function": {"name": "zz"}}}))
            .structured(Some(&tools))
            .unwrap_err();
        assert!(e.message.contains("zz"));
        assert!(chat(json!({"tool_choice": "auto"}))
            .structured(Some(&tools))
            .unwrap()
            .is_none());
        let s = anthropic(json!({"tool_choice": {"type": "tool", "name": "a", "disable_parallel_tool_use": true}}))
            .structured(Some(&tools))
            .unwrap()
            .unwrap();
        assert_eq!((s.tools[0].name.as_str(), s.single_call), ("a", true));
        assert!(
            anthropic(json!({"tool_choice": {"type": "any"}}))
                .structured(Some(&tools))
                .unwrap()
                .unwrap()
                .force_tools
        );
        let s = responses(json!({"tool_choice": {"type": "function", "name": "a"}}))
            .structured(Some(&tools))
            .unwrap()
            .unwrap();
        assert_eq!(s.tools[0].name, "a");
    }
}

mod timings {
    use crate::api::Timings;
    use engine::experts::TierStats;

    #[test]
    fn timings_carry_drafts_only_when_the_request_drafted() {
        let mut t = engine::Timings::default();
        let v = serde_json::to_value(Timings::of(&t)).unwrap();
        assert!(v.get("draft_n").is_none(), "{v}");
        t.draft_n = 10;
        t.draft_n_accepted = 6;
        let v = serde_json::to_value(Timings::of(&t)).unwrap();
        assert_eq!(
            (v["draft_n"].clone(), v["draft_n_accepted"].clone()),
            (10.into(), 6.into())
        );
    }

    #[test]
    fn timings_carry_the_request_s_expert_tiers_only_when_tiered() {
        let mut t = engine::Timings {
            prompt_n: 4,
            prompt_ms: 2.0,
            ..Default::default()
        };
        let v = serde_json::to_value(Timings::of(&t)).unwrap();
        assert_eq!(v["prompt_per_token_ms"], 0.5);
        assert!(v.get("experts").is_none(), "{v}");
        t.experts = Some(TierStats {
            hits: 6,
            disk_misses: 2,
            disk_bytes: 4096,
            ..Default::default()
        });
        let v = serde_json::to_value(Timings::of(&t)).unwrap();
        let e = &v["experts"];
        assert_eq!(e["vram"]["uses"], 6);
        assert_eq!(e["vram"]["hit_rate"], 0.75);
        assert_eq!(
            (&e["disk"]["uses"], &e["disk"]["bytes"]),
            (&2.into(), &4096.into())
        );
        assert_eq!(e["ram"]["uses"], 0);
    }
}

mod ignore_eos {
    use crate::api::field::FromJson;
    use crate::api::openai::CompletionRequest;
    use crate::settings::RequestDefaults;
    use serde_json::{json, Value};

    fn request(v: Value) -> Result<engine::GenerateRequest, crate::error::ApiError> {
        let p = CompletionRequest::from_json(v)
            .unwrap()
            .params(&RequestDefaults::default(), 1000)?;
        Ok(p.request(vec![1, 2], 8, None))
    }

    /// llama-server's `ignore_eos`: decoding goes on past end-of-generation tokens;
    /// not a boolean is a 400 naming it.
    #[test]
    fn ignore_eos_decodes_past_the_end_token() {
        assert!(request(json!({"prompt": "a"})).unwrap().stop_at_eog);
        assert!(
            !request(json!({"prompt": "a", "ignore_eos": true}))
                .unwrap()
                .stop_at_eog
        );
        assert!(
            request(json!({"prompt": "a", "ignore_eos": false}))
                .unwrap()
                .stop_at_eog
        );
        let e = request(json!({"prompt": "a", "ignore_eos": "yes"})).unwrap_err();
        assert!(e.message.contains("ignore_eos"), "{}", e.message);
    }
}
