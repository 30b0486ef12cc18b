//! The chat template as the operations endpoints see it: its source, whether
//! it opens a thinking block, its tool-call wire format, and `/apply-template`.

use axum::response::Response;
use serde_json::{json, Map, Value};

use model::chat::ChatTemplate;

use super::bad_request;

/// `{source, thinks, tool_call_format}` for `/props` and `/health`.
pub fn describe(t: Option<&ChatTemplate>) -> Value {
    let Some(_t) = t else {
        return json!({"source": null, "thinks": false, "tool_call_format": null});
    };
    json!({"source": null, "thinks": null, "tool_call_format": null})
}

/// Renders `body.messages` (with `tools`, `add_generation_prompt`,
/// `chat_template_kwargs`, `enable_thinking`) through the template.
pub fn render(_t: &ChatTemplate, _body: &Map<String, Value>) -> Result<String, Response> {
    Err(bad_request(
        "the chat template renderer is not built yet",
        None,
    ))
}
