//! The engine worker: one std thread that owns the engine. It takes jobs from a
//! channel and submits them to the engine's scheduler, which admits them to its
//! slots in arrival order and decodes one token of every running request per step
//! (`engine::sched`); between steps it takes the jobs that arrived meanwhile.
//!
//! Each job's `JobSink` gets the engine's callbacks on this thread and does the
//! work that must be synchronous with decoding: incremental detokenization, stop
//! sequences (a match stops the request at once), the thinking budget (forcing the
//! close of the think block), and cancellation (a client that left: its receiver
//! is closed, so the next callback stops the request, while queued, between
//! prompt pieces, or at the next token). Text goes back to the route over a tokio
//! channel.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backlog::EventTx;
use crate::metrics::Stats;
use crate::output::StopMatcher;
use engine::{
    Completion, EngineError, FinishReason, Flow, GenerateRequest, PromptProgress, Timings,
    TokenEvent,
};

use crate::access::RequestLog;

/// What the worker drives: `engine::Engine` in the server (its scheduler, through
/// `submit` and `step`); scripted fakes in tests, which decode one request at a time
/// through `generate`. (Not `model::Backend`, the seam of a forward pass's ops.)
pub trait Generator: Send + 'static {
    /// Decodes `req`: `on_prompt` after each piece of the prompt (`Flow::Stop` ends
    /// the request before its first token), `on_token` after each token.
    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
    ) -> Result<Completion, String>;

    /// Takes a request; `step` decodes it. By default it runs to its end here,
    /// through `generate`.
    fn submit(&mut self, req: GenerateRequest, mut sink: Box<JobSink>) {
        if sink.cancelled_now() {
            sink.finish(Ok(stopped(req.sampling.seed.unwrap_or(0))));
            return;
        }
        engine::RequestCallbacks::admitted(sink.as_mut(), 0, 0);
        let cell = RefCell::new(sink.as_mut());
        let r = self.generate(
            &req,
            &mut |p| engine::RequestCallbacks::prompt(&mut **cell.borrow_mut(), p),
            &mut |t| engine::RequestCallbacks::token(&mut **cell.borrow_mut(), t),
        );
        sink.finish(r);
    }

    /// One scheduler step; true while submitted requests remain.
    fn step(&mut self) -> bool {
        false
    }

    /// The slots and what each holds (None: one slot, nothing to report).
    fn slots(&self) -> Option<Vec<engine::SlotInfo>> {
        None
    }

    /// Sequences the last `step` decoded together (0: none, or not known).
    fn last_step_size(&self) -> usize {
        0
    }

    /// How prompts were served from cached state (None: not known).
    fn cache_report(&self) -> Option<engine::CacheReport> {
        None
    }

    /// Where steps run and the device memory held (None: nothing to report, as
    /// for the scripted test generators).
    fn device_report(&self) -> Option<engine::DeviceReport> {
        None
    }

    /// Where the routed experts computed so far came from, when they are tiered.
    fn expert_stats(&self) -> Option<engine::experts::TierStats> {
        None
    }

    /// What the reads of experts from the model file have done (reads, retries,
    /// failures, stalls); None when no expert is read from the file.
    fn expert_reads(&self) -> Option<engine::experts::ReadCounters> {
        None
    }

    /// A fault that keeps some requests from being served now (the model file
    /// changed, an expert read is stuck), in words; None while healthy.
    fn standing_fault(&self) -> Option<String> {
        None
    }

    /// What the server goes on serving with but slower or with some requests
    /// failing (the GPU short of memory), in words; None while there is none.
    fn standing_warning(&self) -> Option<String> {
        None
    }

    /// The executor's failure after which it runs nothing more (`Engine::fatal`).
    fn fatal(&self) -> Option<String> {
        None
    }
}

impl Generator for engine::Engine {
    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
        on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
    ) -> Result<Completion, String> {
        engine::Engine::generate_with_progress(self, req, on_prompt, on_token)
            .map_err(|e| e.to_string())
    }

    fn submit(&mut self, req: GenerateRequest, sink: Box<JobSink>) {
        engine::Engine::submit(self, req, sink);
    }

    fn step(&mut self) -> bool {
        engine::Engine::step(self)
    }

    fn slots(&self) -> Option<Vec<engine::SlotInfo>> {
        Some(engine::Engine::slots(self))
    }

    fn last_step_size(&self) -> usize {
        engine::Engine::last_step_size(self)
    }

    fn cache_report(&self) -> Option<engine::CacheReport> {
        Some(engine::Engine::cache_report(self))
    }

    fn device_report(&self) -> Option<engine::DeviceReport> {
        Some(engine::Engine::device_report(self))
    }

    fn expert_stats(&self) -> Option<engine::experts::TierStats> {
        engine::Engine::expert_stats(self)
    }

    fn expert_reads(&self) -> Option<engine::experts::ReadCounters> {
        engine::Engine::expert_reads(self)
    }

    fn standing_fault(&self) -> Option<String> {
        engine::Engine::standing_fault(self)
    }

    fn standing_warning(&self) -> Option<String> {
        engine::Engine::standing_warning(self)
    }

    fn fatal(&self) -> Option<String> {
        engine::Engine::fatal(self).map(str::to_string)
    }
}

fn stopped(seed: u64) -> Completion {
    Completion {
        tokens: Vec::new(),
        finish: FinishReason::Stopped,
        timings: Timings::default(),
        seed,
    }
}

/// Turns token ids into text, incrementally. The tokenizer's stream decoder in the
/// server; a table in tests.
pub trait Detokenizer: Send {
    fn push(&mut self, id: u32) -> String;
    fn finish(&mut self) -> String;
}

impl Detokenizer for model::tokenizer::StreamDecoder {
    fn push(&mut self, id: u32) -> String {
        model::tokenizer::StreamDecoder::push(self, id)
    }
    fn finish(&mut self) -> String {
        model::tokenizer::StreamDecoder::finish(self)
    }
}

/// How the think block is handled for one request.
#[derive(Debug, Clone, Default)]
pub struct ThinkPlan {
    /// The prompt leaves the model inside an open think block.
    pub open_at_start: bool,
    /// Generated-token index at which an open think block is closed.
    pub limit: Option<usize>,
    /// Forced to close it: the budget sentence, `</think>`, and a blank line.
    pub close_tokens: Vec<u32>,
    pub open_id: Option<u32>,
    pub close_id: Option<u32>,
}

/// The sentence Qwen's own thinking-budget recipe inserts before `</think>`.
pub const BUDGET_CLOSE_TEXT: &str = "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now.\n</think>\n\n";

/// Where the server closes the think block: the request's budget, and (when the
/// answer room is on) early enough that `room` tokens of `max_tokens` remain for the
/// answer, where room = max(answer_room, 15% of max_tokens), capped at half the
/// budget so a small request still thinks. `close_len` is the forced close's length.
pub fn thinking_limit(
    max_tokens: usize,
    budget: Option<usize>,
    answer_room: usize,
    close_len: usize,
) -> Option<usize> {
    let room_limit = if answer_room > 0 {
        let room = answer_room.max(max_tokens * 15 / 100).min(max_tokens / 2);
        Some(max_tokens.saturating_sub(room + close_len).max(1))
    } else {
        None
    };
    match (budget, room_limit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What a job sends back.
#[derive(Debug)]
pub enum Event {
    /// Generated text (stop sequences already removed).
    Text(String),
    /// A generated token's log-probabilities (requests that asked for them; the
    /// end-of-generation token has none).
    Logprobs(u32, engine::TokenLogprobs),
    Done(Finished),
    Failed(String),
}

/// The end of a request.
#[derive(Debug, Clone)]
pub struct Finished {
    pub finish: FinishReason,
    /// The stop sequence that ended it, if one did.
    pub stop_hit: Option<String>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Generated tokens inside the think block.
    pub reasoning_tokens: usize,
    pub timings: Timings,
    pub seed: u64,
}

/// One request for the worker.
pub struct Job {
    pub id: u64,
    pub req: GenerateRequest,
    pub think: ThinkPlan,
    pub stops: Vec<String>,
    pub detok: Box<dyn Detokenizer>,
    /// The request's log record: told what the engine reused and generated as it
    /// happens, so a request whose client leaves is logged with what was done.
    pub log: RequestLog,
    /// Where its events go (`backlog::channel`: bounded by what waits unread).
    pub tx: EventTx,
}

/// What the worker thread is sent.
enum Msg {
    Job(Box<Job>),
    /// End every request, drop the engine (which waits for the prompt cache's
    /// writes), then say so on the sender and leave.
    Stop(mpsc::Sender<()>),
}

/// The handle routes submit jobs through.
pub struct Worker {
    jobs: mpsc::Sender<Msg>,
    /// Set when the server stops: every request ends at its next prompt piece or
    /// token (or while queued) with an error saying so.
    stopping: Arc<AtomicBool>,
}

/// What a request ended by the server's stop gets as its final event.
pub const STOPPING_TEXT: &str =
    "the server is shutting down and ended this request before it finished; retry it (on another server, or when this one is back)";

/// How often the device report and expert statistics are re-read while the
/// engine is busy (and always when it goes idle).
const REPORT_EVERY: Duration = Duration::from_millis(500);

impl Worker {
    pub fn spawn(generator: Box<dyn Generator>, stats: Arc<Stats>) -> std::io::Result<Worker> {
        let (jobs, rx) = mpsc::channel::<Msg>();
        let stopping = Arc::new(AtomicBool::new(false));
        let flag = stopping.clone();
        std::thread::Builder::new()
            .name("scoria-engine".into())
            .spawn(move || serve(generator, stats, rx, flag))?;
        Ok(Worker { jobs, stopping })
    }

    pub fn submit(&self, job: Job) -> Result<(), String> {
        self.jobs
            .send(Msg::Job(Box::new(job)))
            .map_err(|_| "the engine worker has stopped".to_string())
    }

    /// Ends every request now (queued ones too, and any submitted later), each
    /// with a final error event ([`STOPPING_TEXT`]); the engine stays.
    pub fn end_requests(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// Ends every request, then drops the engine, which waits for the prompt
    /// cache's writes to finish; true when that was done within `wait` (else the
    /// thread is left to it: a cache file is written whole or not at all).
    pub fn stop(&self, wait: Duration) -> bool {
        self.end_requests();
        let (done, rx) = mpsc::channel();
        if self.jobs.send(Msg::Stop(done)).is_err() {
            return true;
        }
        rx.recv_timeout(wait).is_ok()
    }
}

/// The worker thread: submit what arrived, step while there is work, wait for a
/// job when there is none.
fn serve(
    mut generator: Box<dyn Generator>,
    stats: Arc<Stats>,
    rx: mpsc::Receiver<Msg>,
    stopping: Arc<AtomicBool>,
) {
    let mut busy = false;
    let mut reported = Instant::now();
    let mut stop: Option<mpsc::Sender<()>> = None;
    // A standing fault or warning is re-read while idle, so /health sees it clear.
    let mut fault = false;
    loop {
        if stop.is_some() && !busy {
            // Every request has ended: dropping the engine waits for the prompt
            // cache's writer to finish what it was given.
            drop(generator);
            // Jobs sent from here on are refused at `submit`.
            drop(rx);
            if let Some(done) = stop {
                let _ = done.send(());
            }
            return;
        }
        let first = if busy || stop.is_some() {
            rx.try_recv().ok()
        } else if fault {
            match rx.recv_timeout(REPORT_EVERY) {
                Ok(m) => Some(m),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    fault = report_fault(generator.as_ref(), &stats);
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(j) => Some(j),
                Err(_) => return,
            }
        };
        for msg in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            let job = match msg {
                Msg::Job(job) => *job,
                Msg::Stop(done) => {
                    stopping.store(true, Ordering::SeqCst);
                    stop = Some(done);
                    continue;
                }
            };
            let (req, sink) = job.into_parts(&stats, &stopping);
            // A scripted generator runs the job here; a panic fails only that job.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                generator.submit(req, sink)
            }));
        }
        // A panic drops the step's requests (their sinks report the failure) and
        // the engine starts those slots over.
        busy = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| generator.step()))
            .unwrap_or(true);
        let ran = generator.last_step_size();
        if ran > 0 {
            stats.engine_step(ran);
        }
        if let Some(slots) = generator.slots() {
            stats.set_slots(
                slots
                    .into_iter()
                    .map(|s| crate::metrics::SlotView {
                        id: s.id,
                        busy: s.busy,
                        cached_tokens: s.cached_tokens,
                        request: None,
                    })
                    .collect(),
            );
        }
        if !busy || reported.elapsed() >= REPORT_EVERY {
            reported = Instant::now();
            if let Some(report) = generator.device_report() {
                stats.set_device(report);
            }
            if let Some(t) = generator.expert_stats() {
                stats.set_expert_stats(&t);
            }
            if let Some(c) = generator.cache_report() {
                stats.set_cache_report(c);
            }
            fault = report_fault(generator.as_ref(), &stats);
        }
    }
}

/// Gives the statistics the engine's expert-read counters and standing fault and
/// warning; true while either stands.
fn report_fault(generator: &dyn Generator, stats: &Stats) -> bool {
    if let Some(c) = generator.expert_reads() {
        stats.set_expert_reads(c);
    }
    if let Some(f) = generator.fatal() {
        stats.set_fatal(f);
    }
    let warning = generator.standing_warning();
    let warned = warning.is_some();
    stats.set_warning(warning);
    let fault = generator.standing_fault();
    let standing = fault.is_some();
    stats.set_fault(fault);
    standing || warned
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Eog => "stop",
        FinishReason::Stopped => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

/// Runs `job` on `generator` to its end (tests, and the scripted generators).
pub fn run_job(generator: &mut dyn Generator, stats: &Arc<Stats>, job: Job) {
    let (req, sink) = job.into_parts(stats, &Arc::new(AtomicBool::new(false)));
    generator.submit(req, sink);
    while generator.step() {}
}

impl Job {
    fn into_parts(
        self,
        stats: &Arc<Stats>,
        stopping: &Arc<AtomicBool>,
    ) -> (GenerateRequest, Box<JobSink>) {
        let Job {
            id,
            req,
            think,
            stops,
            detok,
            tx,
            log,
        } = self;
        let sink = JobSink {
            id,
            stats: stats.clone(),
            prompt_tokens: req.prompt.len(),
            stop: StopMatcher::new(stops),
            in_think: think.open_at_start,
            think,
            detok,
            tx,
            log,
            closed_by_budget: false,
            reasoning_tokens: 0,
            stop_hit: None,
            cancelled: false,
            started: false,
            first: true,
            left_in_prompt: None,
            prompt_done: 0,
            finished: false,
            stopping: stopping.clone(),
            too_slow: false,
        };
        (req, Box::new(sink))
    }
}

/// One job's side of decoding: text out, stops, the thinking budget,
/// cancellation, and the statistics.
pub struct JobSink {
    id: u64,
    stats: Arc<Stats>,
    prompt_tokens: usize,
    think: ThinkPlan,
    stop: StopMatcher,
    detok: Box<dyn Detokenizer>,
    tx: EventTx,
    log: RequestLog,
    in_think: bool,
    closed_by_budget: bool,
    reasoning_tokens: usize,
    stop_hit: Option<String>,
    cancelled: bool,
    started: bool,
    first: bool,
    left_in_prompt: Option<(usize, usize)>,
    /// Prompt tokens in the state so far.
    prompt_done: usize,
    finished: bool,
    /// The server is stopping ([`Worker::end_requests`]).
    stopping: Arc<AtomicBool>,
    /// Stopped because the client left more than the limit unread.
    too_slow: bool,
}

impl JobSink {
    fn cancelled_now(&self) -> bool {
        self.tx.is_closed() || self.stopping()
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    /// Why the server (not the model, a stop sequence or the client) ended the
    /// request, if it did.
    fn ended_by_server(&self, result: &Result<Completion, String>) -> Option<String> {
        let stopped =
            matches!(result, Ok(c) if c.finish == FinishReason::Stopped) && self.stop_hit.is_none();
        if !stopped || self.tx.is_closed() {
            return None;
        }
        if self.too_slow {
            return Some(format!(
                "the client did not read its stream: {} bytes of output waited unread (the limit is {}), so the request was stopped to bound the server's memory",
                self.tx.unread(),
                self.tx.limit()
            ));
        }
        self.stopping().then(|| STOPPING_TEXT.to_string())
    }

    /// The request ended: the tail of the text, the statistics, and `Done` or
    /// `Failed` to the route.
    pub fn finish(&mut self, result: Result<Completion, String>) {
        self.finished = true;
        let id = self.id;
        if let Some(why) = self.ended_by_server(&result) {
            tracing::warn!("request {id}: {why}");
            self.stats.request_failed(id, &why);
            let _ = self.tx.send(Event::Failed(why));
            return;
        }
        if !self.started {
            let why = match &result {
                Ok(_) => "cancelled: the client left while queued".to_string(),
                Err(e) => e.clone(),
            };
            self.stats.request_failed(id, &why);
            if result.is_err() {
                let _ = self.tx.send(Event::Failed(why));
            }
            return;
        }
        let left_in_prompt = match (&result, self.left_in_prompt) {
            (_, Some(p)) => Some(p),
            // Stopped between prompt pieces because the client had gone.
            (Ok(c), None) if c.tokens.is_empty() && self.first && self.tx.is_closed() => {
                Some((self.prompt_done, self.prompt_tokens))
            }
            _ => None,
        };
        if let Some((done, total)) = left_in_prompt {
            self.stats.request_failed(
                id,
                &format!(
                    "cancelled: the client left while the prompt was read ({done} of {total} tokens)"
                ),
            );
            return;
        }
        match result {
            Ok(c) => {
                if self.stop_hit.is_none() && !self.cancelled {
                    let tail = self.detok.finish();
                    let (mut emit, hit) = self.stop.push(&tail);
                    if hit.is_some() {
                        self.stop_hit = hit;
                    } else {
                        emit.push_str(&self.stop.finish());
                    }
                    if !emit.is_empty() {
                        let _ = self.tx.send(Event::Text(emit));
                    }
                }
                let finish = if self.stop_hit.is_some() {
                    FinishReason::Stopped
                } else {
                    c.finish
                };
                if self.cancelled || (c.finish == FinishReason::Stopped && self.tx.is_closed()) {
                    self.stats
                        .request_failed(id, "cancelled: the client disconnected");
                } else {
                    self.stats.request_finished(
                        id,
                        &c.timings,
                        finish_str(finish),
                        self.prompt_tokens + c.tokens.len(),
                    );
                }
                let _ = self.tx.send(Event::Done(Finished {
                    finish,
                    stop_hit: self.stop_hit.take(),
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: c.tokens.len(),
                    reasoning_tokens: self.reasoning_tokens,
                    timings: c.timings,
                    seed: c.seed,
                }));
            }
            Err(e) => {
                self.stats.request_failed(id, &e);
                let _ = self.tx.send(Event::Failed(e));
            }
        }
    }
}

impl Drop for JobSink {
    fn drop(&mut self) {
        // Dropped unfinished: the engine failed (panicked) on its step.
        if !self.finished {
            self.stats
                .request_failed(self.id, "the engine failed (panic) on this request");
        }
    }
}

impl engine::RequestCallbacks for JobSink {
    fn admitted(&mut self, slot: usize, cached: usize) {
        self.started = true;
        self.prompt_done = cached;
        self.stats.request_started(self.id, self.prompt_tokens);
        self.stats.request_slot(self.id, slot);
        self.stats.request_cached(self.id, cached);
        self.log.admitted(cached);
    }

    fn prompt(&mut self, p: &PromptProgress) -> Flow {
        self.prompt_done = p.done;
        self.stats.prompt_progress(self.id, p.done);
        if self.stopping() {
            return Flow::Stop;
        }
        if self.tx.is_closed() {
            self.left_in_prompt = Some((p.done, p.total));
            return Flow::Stop;
        }
        Flow::Continue
    }

    fn token(&mut self, ev: &TokenEvent) -> Flow {
        if self.first {
            self.stats.prompt_progress(self.id, self.prompt_tokens);
            self.first = false;
        }
        self.stats.token_generated(self.id);
        self.log.token_generated();
        if let (Some(lp), false) = (ev.logprobs, ev.eog) {
            let _ = self.tx.send(Event::Logprobs(ev.token, lp));
        }
        let think = &self.think;
        let bypass_stops = self.in_think || ev.forced || Some(ev.token) == think.open_id;
        if Some(ev.token) == think.open_id && !self.in_think {
            self.in_think = true;
        }
        if self.in_think {
            self.reasoning_tokens += 1;
        }
        if Some(ev.token) == think.close_id {
            self.in_think = false;
        }
        if ev.eog {
            return Flow::Continue;
        }
        let text = self.detok.push(ev.token);
        let (emit, hit) = if bypass_stops {
            (text, None)
        } else {
            self.stop.push(&text)
        };
        if !emit.is_empty() && self.tx.send(Event::Text(emit)).is_err() {
            self.cancelled = true;
            return Flow::Stop;
        }
        if let Some(s) = hit {
            self.stop_hit = Some(s);
            return Flow::Stop;
        }
        if self.tx.is_closed() {
            self.cancelled = true;
            return Flow::Stop;
        }
        if self.tx.over_limit() {
            self.too_slow = true;
            return Flow::Stop;
        }
        if self.stopping() {
            return Flow::Stop;
        }
        let think = &self.think;
        if self.in_think && !ev.forced && !self.closed_by_budget && !think.close_tokens.is_empty() {
            if let Some(limit) = think.limit {
                if ev.index + 1 >= limit {
                    self.closed_by_budget = true;
                    return Flow::Force(think.close_tokens.clone());
                }
            }
        }
        Flow::Continue
    }

    fn cancelled(&self) -> bool {
        self.tx.is_closed() || self.stopping()
    }

    fn done(&mut self, result: Result<Completion, EngineError>) {
        self.finish(result.map_err(|e| e.to_string()));
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A scripted generator and a table detokenizer, for tests without a model.
    use super::*;

    /// Emits `script` token by token (honouring Stop/Force and max_tokens); token
    /// `eog` ends generation.
    pub struct Scripted {
        pub script: Vec<u32>,
        pub eog: u32,
    }

    impl Generator for Scripted {
        fn generate(
            &mut self,
            req: &GenerateRequest,
            on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
            on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        ) -> Result<Completion, String> {
            let progress = PromptProgress {
                done: req.prompt.len(),
                total: req.prompt.len(),
                cached: 0,
            };
            if on_prompt(&progress) == Flow::Stop {
                return Ok(Completion {
                    tokens: Vec::new(),
                    finish: FinishReason::Stopped,
                    timings: Timings::default(),
                    seed: 7,
                });
            }
            let mut tokens = Vec::new();
            let mut queue: std::collections::VecDeque<(u32, bool)> =
                self.script.iter().map(|&t| (t, false)).collect();
            let mut finish = FinishReason::Length;
            while tokens.len() < req.max_tokens {
                let Some((tok, forced)) = queue.pop_front() else {
                    finish = FinishReason::Eog;
                    break;
                };
                let ev = TokenEvent {
                    token: tok,
                    index: tokens.len(),
                    forced,
                    eog: tok == self.eog,
                    logprobs: None,
                };
                tokens.push(tok);
                let flow = on_token(&ev);
                if ev.eog {
                    finish = FinishReason::Eog;
                    break;
                }
                match flow {
                    Flow::Continue => {}
                    Flow::Stop => {
                        finish = FinishReason::Stopped;
                        break;
                    }
                    Flow::Force(f) => {
                        for t in f.into_iter().rev() {
                            queue.push_front((t, true));
                        }
                    }
                }
            }
            Ok(Completion {
                tokens: tokens.clone(),
                finish,
                timings: Timings {
                    prompt_n: req.prompt.len(),
                    prompt_ms: 1.0,
                    predicted_n: tokens.len(),
                    predicted_ms: 2.0,
                    cache_n: 0,
                    experts: None,
                    ..Default::default()
                },
                seed: 7,
            })
        }
    }

    /// Reads the prompt in `pieces` pieces, `delay` each (reporting after each, and
    /// stopping when told to), then generates as `inner`. `pieces_read` counts them.
    pub struct SlowPrompt {
        pub inner: Scripted,
        pub pieces: usize,
        pub delay: std::time::Duration,
        pub pieces_read: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Generator for SlowPrompt {
        fn generate(
            &mut self,
            req: &GenerateRequest,
            on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
            on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        ) -> Result<Completion, String> {
            let total = req.prompt.len();
            for i in 1..=self.pieces {
                std::thread::sleep(self.delay);
                self.pieces_read
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let progress = PromptProgress {
                    done: total * i / self.pieces,
                    total,
                    cached: 0,
                };
                if on_prompt(&progress) == Flow::Stop {
                    return Ok(Completion {
                        tokens: Vec::new(),
                        finish: FinishReason::Stopped,
                        timings: Timings::default(),
                        seed: 7,
                    });
                }
            }
            self.inner.generate(req, &mut |_| Flow::Continue, on_token)
        }
    }

    /// id -> text table.
    pub struct Table(pub Vec<&'static str>);

    impl Detokenizer for Table {
        fn push(&mut self, id: u32) -> String {
            self.0.get(id as usize).copied().unwrap_or("").to_string()
        }
        fn finish(&mut self) -> String {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    // 0 "<think>" 1 "</think>" 2 "a" 3 "b" 4 "STOP" 5 eog 6 "\n"
    const VOCAB: &[&str] = &["<think>", "</think>", "a", "b", "ST", "", "\n", "OP"];

    fn job(
        script_max: usize,
        think: ThinkPlan,
        stops: Vec<String>,
    ) -> (Job, crate::backlog::EventRx) {
        let (tx, rx) = crate::backlog::channel(usize::MAX);
        let job = Job {
            id: 1,
            req: GenerateRequest {
                prompt: vec![2, 3],
                max_tokens: script_max,
                sampling: Default::default(),
                stop_at_eog: true,
                constraint: None,
                logprobs: None,
                speculative: Default::default(),
                images: Vec::new(),
            },
            think,
            stops,
            detok: Box::new(Table(VOCAB.to_vec())),
            tx,
            log: Default::default(),
        };
        (job, rx)
    }

    fn collect(mut rx: crate::backlog::EventRx) -> (String, Finished) {
        let mut text = String::new();
        loop {
            match rx.try_recv() {
                Ok(Event::Text(t)) => text.push_str(&t),
                Ok(Event::Logprobs(..)) => {}
                Ok(Event::Done(f)) => return (text, f),
                Ok(Event::Failed(e)) => panic!("{e}"),
                Err(e) => panic!("{e:?}"),
            }
        }
    }

    #[test]
    fn budget_forces_close_and_answer_follows() {
        let think = ThinkPlan {
            open_at_start: true,
            limit: Some(3),
            close_tokens: vec![6, 1, 6],
            open_id: Some(0),
            close_id: Some(1),
        };
        let (j, rx) = job(20, think, vec![]);
        let mut b = Scripted {
            script: vec![2, 2, 2, 2, 2, 2, 3, 3, 5],
            eog: 5,
        };
        run_job(&mut b, &Arc::new(Stats::new()), j);
        let (text, f) = collect(rx);
        // 3 reasoning tokens, the forced close, then the rest of the script as the answer.
        assert_eq!(text, "aaa\n</think>\naaabb");
        assert_eq!(f.reasoning_tokens, 5);
        assert_eq!(f.finish, FinishReason::Eog);
    }

    #[test]
    fn stop_sequence_across_tokens_stops_engine() {
        let (j, rx) = job(20, ThinkPlan::default(), vec!["STOP".into()]);
        let mut b = Scripted {
            script: vec![2, 4, 7, 3, 3],
            eog: 5,
        };
        run_job(&mut b, &Arc::new(Stats::new()), j);
        let (text, f) = collect(rx);
        assert_eq!(text, "a");
        assert_eq!(f.finish, FinishReason::Stopped);
        assert_eq!(f.stop_hit.as_deref(), Some("STOP"));
        assert_eq!(f.completion_tokens, 3);
    }

    #[test]
    fn stop_sequences_skip_the_think_block() {
        let think = ThinkPlan {
            open_at_start: true,
            limit: None,
            close_tokens: vec![],
            open_id: Some(0),
            close_id: Some(1),
        };
        let (j, rx) = job(20, think, vec!["a".into()]);
        let mut b = Scripted {
            script: vec![2, 3, 1, 3, 2, 3],
            eog: 5,
        };
        run_job(&mut b, &Arc::new(Stats::new()), j);
        let (text, f) = collect(rx);
        assert_eq!(text, "ab</think>b");
        assert_eq!(f.stop_hit.as_deref(), Some("a"));
    }

    #[test]
    fn held_back_partial_stop_is_released_at_end() {
        let (j, rx) = job(3, ThinkPlan::default(), vec!["STOP".into()]);
        let mut b = Scripted {
            script: vec![2, 3, 4],
            eog: 5,
        };
        run_job(&mut b, &Arc::new(Stats::new()), j);
        let (text, f) = collect(rx);
        assert_eq!(text, "abST");
        assert_eq!(f.finish, FinishReason::Length);
    }

    /// Drops the route's receiver after `n` tokens, as a client that disconnects.
    struct DropAfter {
        inner: Scripted,
        rx: Option<crate::backlog::EventRx>,
        n: usize,
        generated: usize,
    }

    impl Generator for DropAfter {
        fn generate(
            &mut self,
            req: &GenerateRequest,
            on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
            on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        ) -> Result<Completion, String> {
            let (n, rx, generated) = (self.n, &mut self.rx, &mut self.generated);
            let c = self.inner.generate(req, on_prompt, &mut |ev| {
                if ev.index + 1 == n {
                    rx.take();
                }
                on_token(ev)
            });
            *generated = c.as_ref().map(|c| c.tokens.len()).unwrap_or(0);
            c
        }
    }

    #[test]
    fn closed_receiver_cancels_within_one_step() {
        // Closed before start: never decoded.
        let (j, rx) = job(100, ThinkPlan::default(), vec![]);
        drop(rx);
        let mut b = DropAfter {
            inner: Scripted {
                script: vec![2; 50],
                eog: 5,
            },
            rx: None,
            n: 0,
            generated: 99,
        };
        run_job(&mut b, &Arc::new(Stats::new()), j);
        assert_eq!(b.generated, 99, "a cancelled queued job must not decode");
        // Closed mid-stream: the engine stops on that very token.
        let (j, rx) = job(100, ThinkPlan::default(), vec![]);
        let mut b = DropAfter {
            inner: Scripted {
                script: vec![2; 50],
                eog: 5,
            },
            rx: Some(rx),
            n: 3,
            generated: 0,
        };
        run_job(&mut b, &Arc::new(Stats::new()), j);
        assert_eq!(b.generated, 3);
    }

    /// Panics on its first request, then behaves.
    struct PanicOnce(bool, Scripted);

    impl Generator for PanicOnce {
        fn generate(
            &mut self,
            req: &GenerateRequest,
            on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
            on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        ) -> Result<Completion, String> {
            if !self.0 {
                self.0 = true;
                panic!("boom");
            }
            self.1.generate(req, on_prompt, on_token)
        }
    }

    #[test]
    fn a_panicking_request_does_not_stop_the_worker() {
        let w = Worker::spawn(
            Box::new(PanicOnce(
                false,
                Scripted {
                    script: vec![2, 5],
                    eog: 5,
                },
            )),
            Arc::new(Stats::new()),
        )
        .unwrap();
        let (j1, mut rx1) = job(5, ThinkPlan::default(), vec![]);
        let (j2, mut rx2) = job(5, ThinkPlan::default(), vec![]);
        w.submit(j1).unwrap();
        w.submit(j2).unwrap();
        assert!(
            rx1.blocking_recv().is_none(),
            "the failed request's channel closes"
        );
        assert!(matches!(rx2.blocking_recv(), Some(Event::Text(_))));
        assert!(matches!(rx2.blocking_recv(), Some(Event::Done(_))));
    }

    /// Reports device memory that grows with every request it serves.
    struct Reporting(Scripted, u64);

    impl Generator for Reporting {
        fn generate(
            &mut self,
            req: &GenerateRequest,
            on_prompt: &mut dyn FnMut(&PromptProgress) -> Flow,
            on_token: &mut dyn FnMut(&TokenEvent) -> Flow,
        ) -> Result<Completion, String> {
            self.1 += 1;
            self.0.generate(req, on_prompt, on_token)
        }
        fn device_report(&self) -> Option<engine::DeviceReport> {
            Some(engine::DeviceReport {
                device: engine::Device::Cuda(0),
                name: "test GPU".into(),
                vram_used: Some(self.1 << 20),
                vram_total: Some(1 << 30),
            })
        }
    }

    #[test]
    fn the_device_report_is_refreshed_after_each_request() {
        let stats = Arc::new(Stats::new());
        let w = Worker::spawn(
            Box::new(Reporting(
                Scripted {
                    script: vec![2, 5],
                    eog: 5,
                },
                0,
            )),
            stats.clone(),
        )
        .unwrap();
        for n in 1..=2u64 {
            let (j, mut rx) = job(5, ThinkPlan::default(), vec![]);
            w.submit(j).unwrap();
            while rx.blocking_recv().is_some() {}
            // The worker refreshes the report right after the job ends.
            let t0 = std::time::Instant::now();
            while stats.device().and_then(|d| d.vram_used) != Some(n << 20) {
                assert!(t0.elapsed().as_secs() < 5, "report not refreshed");
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }

    #[test]
    fn limits() {
        assert_eq!(thinking_limit(8192, None, 0, 25), None);
        assert_eq!(thinking_limit(8192, Some(100), 0, 25), Some(100));
        // room = max(1024, 1228) = 1228
        assert_eq!(thinking_limit(8192, None, 1024, 25), Some(8192 - 1228 - 25));
        assert_eq!(thinking_limit(8192, Some(100), 1024, 25), Some(100));
        // small budgets keep half for the answer
        assert_eq!(thinking_limit(200, None, 1024, 20), Some(80));
    }

    #[test]
    fn a_stopping_worker_ends_requests_with_a_final_event_then_leaves() {
        let stats = Arc::new(Stats::new());
        let w = Worker::spawn(
            Box::new(Scripted {
                script: vec![2; 10],
                eog: 5,
            }),
            stats,
        )
        .expect("spawn");
        let (j, mut rx) = job(10, ThinkPlan::default(), vec![]);
        w.submit(j).expect("submit");
        assert!(matches!(rx.blocking_recv(), Some(Event::Text(t)) if t == "a"));
        w.end_requests();
        let (j, mut rx) = job(10, ThinkPlan::default(), vec![]);
        w.submit(j).expect("submit");
        match rx.blocking_recv() {
            Some(Event::Failed(e)) => assert_eq!(e, STOPPING_TEXT),
            other => panic!("{other:?}"),
        }
        assert!(w.stop(Duration::from_secs(10)), "the engine thread left");
        let (j, _rx) = job(10, ThinkPlan::default(), vec![]);
        assert!(w.submit(j).is_err());
    }
}
