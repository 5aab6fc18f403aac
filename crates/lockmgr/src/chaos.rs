//! Delay injection for tests: an [`Endpoint`] wrapper that stalls randomly before and after
//! batches, so that lock protocols see the slow round trips, reordered clients and stalled
//! holders that a real fabric produces under load (CITRON's aborts, phase (d) waits and
//! starvation avoidance only happen when timing goes wrong).
//!
//! Delays change *when* a batch executes, never *what* it does: a batch still executes whole and
//! in order, so a correct protocol must stay correct under any configuration.

use fabric::{Batch, Capabilities, Completions, Connector, Endpoint, EndpointStats};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How an injected delay waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DelayMode {
    /// Busy-wait (yielding the core between checks): precise, short delays.
    Spin,
    /// `thread::sleep`: coarse (the kernel's timer slack), but frees the core.
    Sleep,
    /// Spin below 50 µs, sleep above.
    Auto,
}

/// What to inject.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChaosConfig {
    /// Probability of a delay before each batch.
    pub before: f64,
    /// Probability of a delay after each batch (the batch has executed; its completion is late).
    pub after: f64,
    /// Longest delay; each delay is uniform in `[0, max_delay]`.
    pub max_delay: Duration,
    /// How delays wait.
    pub mode: DelayMode,
    /// Seed of the first endpoint's random stream (each endpoint gets its own); `None` seeds
    /// from the OS.
    pub seed: Option<u64>,
}

impl Default for ChaosConfig {
    /// A moderate setting: one batch in ten is delayed on either side by up to 100 µs.
    fn default() -> Self {
        Self {
            before: 0.1,
            after: 0.1,
            max_delay: Duration::from_micros(100),
            mode: DelayMode::Auto,
            seed: None,
        }
    }
}

impl ChaosConfig {
    /// No delays at all: the wrapper becomes transparent.
    pub fn off() -> Self {
        Self {
            before: 0.0,
            after: 0.0,
            ..Self::default()
        }
    }
}

/// What a chaos endpoint injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Delays injected.
    pub delays: u64,
    /// Their total length.
    pub delayed: Duration,
}

/// An endpoint that injects random delays around the batches of `E`.
pub struct ChaosEndpoint<E: Endpoint> {
    inner: E,
    config: ChaosConfig,
    rng: SmallRng,
    chaos: ChaosStats,
}

impl<E: Endpoint> ChaosEndpoint<E> {
    /// Wraps `inner`.
    pub fn new(inner: E, config: ChaosConfig) -> Self {
        let rng = match config.seed {
            Some(seed) => SmallRng::seed_from_u64(seed),
            None => SmallRng::from_rng(&mut rand::rng()),
        };
        Self {
            inner,
            config,
            rng,
            chaos: ChaosStats::default(),
        }
    }

    /// What was injected so far.
    pub fn chaos_stats(&self) -> ChaosStats {
        self.chaos
    }

    /// The wrapped endpoint.
    pub fn into_inner(self) -> E {
        self.inner
    }

    fn maybe_delay(&mut self, probability: f64) {
        if probability <= 0.0 || !self.rng.random_bool(probability.min(1.0)) {
            return;
        }
        let max = self.config.max_delay.as_nanos().min(u128::from(u64::MAX)) as u64;
        let delay = Duration::from_nanos(self.rng.random_range(0..=max));
        self.chaos.delays += 1;
        self.chaos.delayed += delay;
        match self.config.mode {
            DelayMode::Sleep => std::thread::sleep(delay),
            DelayMode::Spin => spin(delay),
            DelayMode::Auto if delay >= Duration::from_micros(50) => std::thread::sleep(delay),
            DelayMode::Auto => spin(delay),
        }
    }
}

fn spin(delay: Duration) {
    let until = Instant::now() + delay;
    while Instant::now() < until {
        std::thread::yield_now();
    }
}

impl<E: Endpoint> Endpoint for ChaosEndpoint<E> {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> fabric::Result<()> {
        self.maybe_delay(self.config.before);
        let result = self.inner.execute(batch, out);
        self.maybe_delay(self.config.after);
        result
    }

    /// A procedure call is delayed like a batch: it is one round trip.
    fn call(
        &mut self,
        procedure: fabric::ProcedureId,
        args: &[u8],
        result: &mut Vec<u8>,
    ) -> fabric::Result<()> {
        self.maybe_delay(self.config.before);
        let outcome = self.inner.call(procedure, args, result);
        self.maybe_delay(self.config.after);
        outcome
    }

    /// A posted call is delayed before it is sent, like a batch's request; nothing waits for
    /// its answer.
    fn post_call(&mut self, procedure: fabric::ProcedureId, args: &[u8]) -> fabric::Result<()> {
        self.maybe_delay(self.config.before);
        self.inner.post_call(procedure, args)
    }

    fn stats(&self) -> EndpointStats {
        self.inner.stats()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// A connector whose endpoints are [`ChaosEndpoint`]s over another connector's.
pub struct ChaosConnector<C: Connector> {
    inner: C,
    config: ChaosConfig,
    opened: AtomicU64,
}

impl<C: Connector> ChaosConnector<C> {
    /// Wraps `inner`; every endpoint it opens injects delays per `config`, each with its own
    /// random stream (derived from `config.seed` and the endpoint's number, when seeded).
    pub fn new(inner: C, config: ChaosConfig) -> Self {
        Self {
            inner,
            config,
            opened: AtomicU64::new(0),
        }
    }
}

impl<C: Connector> Connector for ChaosConnector<C> {
    fn connect(&self) -> fabric::Result<Box<dyn Endpoint>> {
        let n = self.opened.fetch_add(1, Ordering::Relaxed);
        let config = ChaosConfig {
            // Distinct, reproducible streams per endpoint (golden-ratio stride).
            seed: self
                .config
                .seed
                .map(|seed| seed.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15))),
            ..self.config
        };
        Ok(Box::new(ChaosEndpoint::new(self.inner.connect()?, config)))
    }
}

/// A one-shot stall, armed from another thread: the next batch an armed [`StallEndpoint`]
/// executes while `when()` holds is held back for `length` before it executes, then the switch
/// disarms itself. It stands for a process stopped by SIGSTOP, a VM pause or a long GC: the
/// client's thread does nothing for a while and then carries on where it was, its timers and
/// the words it posts unchanged. Pick the moment with `when` (for CITRON, e.g. a phase from
/// [`crate::citron::Progress`]).
#[derive(Default)]
pub struct StallSwitch {
    armed: std::sync::Mutex<Option<ArmedStall>>,
    fired: AtomicU64,
}

struct ArmedStall {
    length: Duration,
    skip: u64,
    when: Box<dyn Fn() -> bool + Send>,
}

impl StallSwitch {
    /// A disarmed switch.
    pub fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::default()
    }

    /// Arms the switch: the first batch after `skip` batches that finds `when()` true stalls
    /// for `length`.
    pub fn arm(&self, length: Duration, skip: u64, when: impl Fn() -> bool + Send + 'static) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some(ArmedStall {
            length,
            skip,
            when: Box::new(when),
        });
    }

    /// Disarms the switch without stalling.
    pub fn disarm(&self) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Whether the switch is armed (has not fired yet).
    pub fn is_armed(&self) -> bool {
        self.armed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Stalls fired so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::SeqCst)
    }

    /// Called before each batch: stalls once if armed and due.
    fn check(&self) {
        let length = {
            let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
            let Some(a) = armed.as_mut() else {
                return;
            };
            if a.skip > 0 {
                a.skip -= 1;
                return;
            }
            if !(a.when)() {
                return;
            }
            let length = a.length;
            *armed = None;
            length
        };
        self.fired.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(length);
    }
}

/// An endpoint that stalls before a batch when its [`StallSwitch`] says so (see there).
pub struct StallEndpoint {
    inner: Box<dyn Endpoint>,
    switch: std::sync::Arc<StallSwitch>,
}

impl StallEndpoint {
    /// Wraps `inner`; `switch` is shared with whoever arms it.
    pub fn new(inner: Box<dyn Endpoint>, switch: std::sync::Arc<StallSwitch>) -> Self {
        Self { inner, switch }
    }
}

impl Endpoint for StallEndpoint {
    fn execute(&mut self, batch: &Batch, out: &mut Completions) -> fabric::Result<()> {
        self.switch.check();
        self.inner.execute(batch, out)
    }

    fn call(
        &mut self,
        procedure: fabric::ProcedureId,
        args: &[u8],
        result: &mut Vec<u8>,
    ) -> fabric::Result<()> {
        self.switch.check();
        self.inner.call(procedure, args, result)
    }

    fn post_call(&mut self, procedure: fabric::ProcedureId, args: &[u8]) -> fabric::Result<()> {
        self.switch.check();
        self.inner.post_call(procedure, args)
    }

    fn stats(&self) -> EndpointStats {
        self.inner.stats()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric::{EndpointExt, MemServer, RegionId, RemoteAddr};

    #[test]
    fn delays_happen_and_verbs_are_unchanged() {
        let server = MemServer::new();
        server.register(RegionId(0), 8).unwrap();
        let addr = RemoteAddr::new(RegionId(0), 0);
        let mut ep = ChaosEndpoint::new(
            server.endpoint(),
            ChaosConfig {
                before: 0.5,
                after: 0.5,
                max_delay: Duration::from_micros(20),
                mode: DelayMode::Spin,
                seed: Some(7),
            },
        );
        for i in 0..100 {
            assert_eq!(ep.faa(addr, 1).unwrap(), i);
        }
        assert_eq!(ep.stats().round_trips, 100);
        let injected = ep.chaos_stats().delays;
        assert!((50..150).contains(&injected), "{injected} delays");
    }
}
