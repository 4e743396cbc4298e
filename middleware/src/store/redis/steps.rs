//! A step of a Redis tier (the joint flag and lock's claim and acquire, its release and
//! settle) as one Lua script over any number of deliveries: run for one delivery, or,
//! coalesced, for the deliveries in flight at the same moment in one call. What every step
//! shares is written here, apart from what each decides: how a call is built and answered,
//! and how one delivery's error stays its own.

use std::sync::Arc;

use redis::{FromRedisValue, Script, ScriptInvocation, Value};

use super::{RedisConnection, script};
use crate::error::StoreError;
use crate::store::coalesce::{Batch, Coalescer, Waiter, answer_each, copy_error, still_waiting};

/// Lua: `failure(error)` is the text of an error `pcall` caught.
const LUA_FAILURE: &str = r"
local function failure(error)
    if type(error) == 'table' then
        return error.err or 'script error'
    end
    return tostring(error)
end
";

/// A script that calls `call` (a Lua function of `functions` and its arguments, e.g.
/// `claim, KEYS[k + 1], ARGV[a + 1], ARGV[1]`) once per delivery, in order, and answers
/// each delivery's reply in one array. Delivery `i` (from 0) has `KEYS[k + 1 ..= k +
/// keys_each]` with `k = keys_each * i`, and `ARGV[a + 1 ..= a + args_each]` with `a =
/// shared_args + args_each * i`, after the `shared_args` arguments of every delivery.
///
/// Each delivery runs under `pcall`: one delivery's error (a key of another type) answers
/// that delivery only, as `{-1, error}`, and the deliveries before it keep what they did.
/// Redis runs the deliveries one after the other, so two of one key decide as they would
/// in two calls.
pub(crate) fn per_delivery_script(
    functions: &[&str],
    keys_each: usize,
    shared_args: usize,
    args_each: usize,
    call: &str,
) -> Script {
    let body = format!(
        r"
        local answers = {{}}
        for i = 1, #KEYS / {keys_each} do
            local k, a = {keys_each} * (i - 1), {shared_args} + {args_each} * (i - 1)
            local ok, answer = pcall({call})
            answers[i] = ok and answer or {{-1, failure(answer)}}
        end
        return answers
        "
    );
    script(&[functions, &[LUA_FAILURE]].concat(), &body)
}

/// One step as a [`per_delivery_script`]: what it sends per call and per delivery.
pub(crate) trait Step: Send + Sync + 'static {
    /// One delivery's keys and arguments.
    type Request: Send + Sync + 'static;
    /// One delivery's reply, as the script answers it (never `{-1, error}`).
    type Answer: FromRedisValue + Send + 'static;
    /// Whether a delivery the coalescing task holds still runs once its caller gave up (a
    /// timeout, a shutdown): a settle should, or its claim and lock wait out their leases; a
    /// claim must not, or a claim is taken that nobody settles. (A delivery that found a
    /// slot free runs in its caller's task, and stops with it, as it would uncoalesced.)
    const RUNS_ABANDONED: bool;

    /// The script.
    fn script(&self) -> &'static Script;

    /// Adds the arguments every delivery of a call shares.
    fn add_shared(&self, invocation: &mut ScriptInvocation<'_>);

    /// Adds one delivery's keys and arguments.
    fn add(&self, invocation: &mut ScriptInvocation<'_>, request: &Self::Request);
}

/// A step's calls on one connection.
struct Calls<S, C> {
    step: S,
    connection: C,
}

impl<S: Step, C: RedisConnection> Calls<S, C> {
    /// Answers each delivery, or the error it met; an error of the call fails every
    /// delivery.
    async fn call(&self, requests: &[S::Request]) -> Result<Vec<Result<S::Answer, StoreError>>, StoreError> {
        let mut invocation = self.step.script().prepare_invoke();
        self.step.add_shared(&mut invocation);
        for request in requests {
            self.step.add(&mut invocation, request);
        }
        let replies: Vec<Value> = invocation.invoke_async(&mut self.connection.clone()).await?;
        Ok(replies.into_iter().map(answer).collect())
    }
}

/// One delivery's answer from its reply: `{-1, error}` is the error `pcall` caught.
fn answer<Answer: FromRedisValue>(reply: Value) -> Result<Answer, StoreError> {
    if let Value::Array(items) = &reply
        && let [Value::Int(-1), error] = items.as_slice()
    {
        let error = String::from_redis_value_ref(error).unwrap_or_else(|_| format!("{error:?}"));
        return Err(StoreError::new(error));
    }
    Answer::from_redis_value(reply).map_err(|error| StoreError::malformed(error.to_string()))
}

impl<S: Step, C: RedisConnection> Batch for Arc<Calls<S, C>> {
    type Request = S::Request;
    type Answer = S::Answer;

    async fn run(&self, waiters: Vec<Waiter<S::Request, S::Answer>>) {
        let waiters: Vec<_> = if S::RUNS_ABANDONED {
            waiters
        } else {
            still_waiting(waiters).collect()
        };
        if waiters.is_empty() {
            return;
        }
        let (requests, replies): (Vec<_>, Vec<_>) = waiters.into_iter().unzip();
        match self.call(&requests).await {
            Ok(answers) => answer_each(replies, answers),
            Err(error) => answer_each(replies, std::iter::repeat_with(|| Err(copy_error(&error)))),
        }
    }
}

/// A step, run for each delivery in a call of its own or, coalesced, for concurrent
/// deliveries together. Clones share the calls and the coalescing task.
pub(crate) struct Runner<S: Step, C> {
    calls: Arc<Calls<S, C>>,
    coalescer: Option<Coalescer<S::Request, S::Answer>>,
}

impl<S: Step, C: RedisConnection> Runner<S, C> {
    /// `step` on `connection`, each delivery in a call of its own.
    pub(crate) fn new(step: S, connection: C) -> Self {
        Runner {
            calls: Arc::new(Calls { step, connection }),
            coalescer: None,
        }
    }

    /// The same, the deliveries in flight at the same moment sharing calls: up to
    /// `max_deliveries` per call and `max_calls` calls on the wire at once (see
    /// [`Coalescer::spawn`]). Starts a task on the current Tokio runtime.
    pub(crate) fn coalesced(self, max_deliveries: usize, max_calls: usize) -> Self {
        Runner {
            coalescer: Some(Coalescer::spawn(self.calls.clone(), max_deliveries, max_calls)),
            calls: self.calls,
        }
    }

    /// Runs the step for one delivery.
    pub(crate) async fn run(&self, request: S::Request) -> Result<S::Answer, StoreError> {
        match &self.coalescer {
            Some(coalescer) => coalescer.ask(request).await,
            None => self
                .calls
                .call(std::slice::from_ref(&request))
                .await?
                .into_iter()
                .next()
                .unwrap_or_else(|| Err(StoreError::malformed("a Redis script answered no delivery"))),
        }
    }
}

impl<S: Step, C> Clone for Runner<S, C> {
    fn clone(&self) -> Self {
        Runner {
            calls: self.calls.clone(),
            coalescer: self.coalescer.clone(),
        }
    }
}
