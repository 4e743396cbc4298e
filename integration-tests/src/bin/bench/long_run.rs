//! `--long`: a million messages through the RabbitMQ runner with the `amqp` benchmark's
//! "full stack, batched record" (the Redis flag with the record behind it and the Redis lock
//! as one tier, the record batched on PostgreSQL, the handler inserting a stock move in its
//! transaction): memory flat and throughput steady over a long drain, which seconds cannot show.
//!
//! The messages are published first, in chunks (unconfirmed, each awaited until the queue
//! holds it, which bounds the publisher's buffers), then drained by the runner in the bench
//! process while a sampler reads, every 10 s, the deliveries settled in that window and the
//! process's resident memory (`VmRSS`); the stack reads it as the 100,000th delivery settles.
//! Targets: no reading after that one above 1.10× it, no full window under half the median
//! full window. The windows go into the report as a table, and into `benchmarks-long.svg`.
//! `ONCELY_BENCH_LONG_MESSAGES` and `ONCELY_BENCH_LONG_WINDOW_S` (for smoke tests, not users)
//! shrink the run; the memory is then read at a tenth of it.

use std::error::Error;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use integration_tests::amqp::{connect, ready_messages, scratch_topology};
use integration_tests::postgres::{BoxedStack, boxed};
use integration_tests::thousands;
use lapin::Channel;
use oncely::{Envelope, KeyExtractor, Outcome, Route};
use oncely_amqp::{DEFAULT_PREFETCH, Runner, Topology};
use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;

use crate::amqp_end_to_end::consume::{publish, wait_until_ready};
use crate::amqp_end_to_end::services::{Record, Services, Store};
use crate::chart::{self, AXIS_AREA, AXIS_SIZE, FONT, MARGIN, TEXT_FACE, WIDTH, Y_AXIS_AREA};
use crate::measure::median;
use crate::report::{Plot, Report, Row, Section, Target};
use crate::workload;

/// The plot's file name, beside `BENCHMARKS.md`, which links it from the run's note.
pub(crate) const CHART: &str = "benchmarks-long.svg";
/// Messages in the run.
const MESSAGES: usize = 1_000_000;
/// Resident memory is read as this many deliveries have settled (or a tenth of a shorter
/// run): by then the stack's pools, lanes and buffers have all filled once.
const MEMORY_MARK: usize = 100_000;
/// The most resident memory may grow past what it was at [`MEMORY_MARK`].
const MEMORY_GROWTH: f64 = 1.10;
/// The least a full window may carry of the median full window.
const SLOWEST_WINDOW: f64 = 0.5;
/// Messages published before the publisher waits for the queue to hold them.
const CHUNK: usize = 20_000;
/// How often the sampler counts and reads the memory.
const WINDOW: Duration = Duration::from_secs(10);
/// How often the sampler looks whether the run is over or a window has ended.
const POLL: Duration = Duration::from_millis(10);
/// Overrides of [`MESSAGES`] and [`WINDOW`] (in seconds), for a smoke test.
const MESSAGES_ENV: &str = "ONCELY_BENCH_LONG_MESSAGES";
const WINDOW_ENV: &str = "ONCELY_BENCH_LONG_WINDOW_S";
/// The heights of the plot's two panels: throughput, then memory.
const RATE_HEIGHT: u32 = 300;
const MEMORY_HEIGHT: u32 = 260;

/// One window of the sampler's.
struct Window {
    /// Seconds from the first delivery.
    start: f64,
    end: f64,
    /// Deliveries the stack settled in the window.
    settled: u64,
    /// The process's resident memory at the window's end, in KiB.
    resident_kib: u64,
    /// Ended by the clock, not by the last delivery.
    full: bool,
}

impl Window {
    /// Deliveries settled per second over the window.
    fn per_second(&self) -> f64 {
        self.settled as f64 / (self.end - self.start).max(f64::EPSILON)
    }
}

/// The resident memory read as the [`MEMORY_MARK`]th delivery settled.
struct Mark {
    settled: u64,
    /// Seconds from the first delivery.
    at: f64,
    resident_kib: u64,
}

/// What a run measured.
struct Run {
    messages: usize,
    window: Duration,
    publish_seconds: f64,
    /// The resident memory at the first delivery, in KiB.
    first_kib: u64,
    windows: Vec<Window>,
    mark: Mark,
}

impl Run {
    /// The median of the full windows' rates (of every window's, if none is full).
    fn median_rate(&self) -> f64 {
        let full: Vec<f64> = self.full_windows().map(Window::per_second).collect();
        let every = || self.windows.iter().map(Window::per_second).collect();
        median(if full.is_empty() { every() } else { full })
    }

    /// The windows the clock ended: the last, cut short by the last delivery, is left out.
    fn full_windows(&self) -> impl Iterator<Item = &Window> {
        self.windows.iter().filter(|window| window.full)
    }

    /// The slowest full window's rate as a multiple of the median full window's, if any
    /// window was full.
    fn slowest_ratio(&self) -> Option<f64> {
        let slowest = self.full_windows().map(Window::per_second).reduce(f64::min);
        slowest.map(|slowest| slowest / self.median_rate())
    }

    /// The most resident memory read after the mark, in KiB (the mark's, if none was).
    fn peak_after_mark_kib(&self) -> u64 {
        (self.windows.iter())
            .filter(|window| window.end >= self.mark.at)
            .map(|window| window.resident_kib)
            .max()
            .unwrap_or(self.mark.resident_kib)
    }

    /// Seconds from the first delivery to the last.
    fn seconds(&self) -> f64 {
        self.windows.last().map_or(0.0, |window| window.end)
    }
}

/// The run's setting `name` from the environment, else `default`.
fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    let value = std::env::var(name).unwrap_or_default().replace(['_', ','], "");
    value.parse().unwrap_or(default)
}

/// The process's resident memory in KiB: `VmRSS` in `/proc/self/status` (Linux), 0 where
/// that cannot be read.
fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = status.lines().find_map(|line| line.strip_prefix("VmRSS:"));
    let kib = field.and_then(|rest| rest.split_whitespace().next()?.parse().ok());
    kib.unwrap_or(0)
}

/// Mebibytes of `kib`.
fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Publishes, measures and reports the long run: its targets, its table and note, and
/// its plot in [`CHART`] beside `BENCHMARKS.md`.
pub(crate) async fn run(report: &mut Report) {
    let messages = setting(MESSAGES_ENV, MESSAGES);
    let window = Duration::from_secs_f64(setting(WINDOW_ENV, WINDOW.as_secs_f64()));
    let services = Services::start().await;
    let topology = scratch_topology("bench-long");
    let run = measure(&services, &topology, messages, window).await;
    (topology.delete(&services.channel).await).expect("delete the long run's queues");
    let title = format!(
        "Long run: {} messages through the RabbitMQ runner (prefetch {DEFAULT_PREFETCH}), full stack, \
         batched record on PostgreSQL, in {}-s windows",
        thousands(messages as f64),
        window.as_secs_f64()
    );
    let written = write_chart(render(&run, &title));
    add_targets(report, &run);
    report.add(Section {
        rows: rows(&run),
        note: Some(note(&run, written)),
        title,
        baseline_name: "the median full window",
        unit: Some("messages"),
        plot: Plot::None,
    });
}

/// The `amqp` benchmark's "full stack, batched record" on `services`, behind a layer that
/// tells `progress` of the first delivery and of each settled one.
async fn full_stack_batched(services: &Services, progress: Arc<Progress>) -> BoxedStack {
    let stack = services.full_stack(services.record(Store::Postgres, Record::Batched));
    let stamp = progress.clone();
    boxed(
        ServiceBuilder::new()
            .map_request(move |envelope: Envelope| {
                stamp.first_delivery.get_or_init(Instant::now);
                envelope
            })
            .map_response(move |outcome: Outcome| {
                // A delivery to be retried comes back, and settles then.
                if !matches!(outcome, Outcome::RetryLater(_)) {
                    progress.settle();
                }
                outcome
            })
            .service(stack.await),
    )
}

/// What the stack has done so far, shared between it and the sampler.
struct Progress {
    /// Deliveries settled: the stack answered (the record committed), the runner acks.
    settled: AtomicU64,
    first_delivery: OnceLock<Instant>,
    /// The delivery at whose settling the memory is read, and when and what was read.
    mark: u64,
    at_mark: OnceLock<(Instant, u64)>,
}

impl Progress {
    /// Counts a settled delivery; reads the memory if it is the mark's.
    fn settle(&self) {
        if self.settled.fetch_add(1, Ordering::Relaxed) + 1 == self.mark {
            let _ = self.at_mark.set((Instant::now(), resident_kib()));
        }
    }

    /// Deliveries settled so far.
    fn settled(&self) -> u64 {
        self.settled.load(Ordering::Relaxed)
    }
}

/// Fills a fresh queue of `topology` with `messages` orders never seen before, a product
/// each (so that the lock never makes one wait for another), in chunks of [`CHUNK`], each
/// awaited until the broker counts it, so that the publisher's buffers never hold more than
/// a chunk, nor the bench process the whole workload.
async fn publish_in_chunks(channel: &Channel, topology: &Topology, messages: usize) {
    topology.declare(channel).await.expect("declare");
    let mut published = 0;
    while published < messages {
        let chunk = workload::fresh(CHUNK.min(messages - published));
        publish(channel, topology.queue(), &chunk).await;
        published += chunk.len();
        wait_until_ready(channel, topology.queue(), published).await;
    }
}

/// Publishes `messages`, then drains them through a runner of the full stack at its defaults
/// on a connection of its own, as the README runs it, sampling every `window`.
async fn measure(services: &Services, topology: &Topology, messages: usize, window: Duration) -> Run {
    let publishing = Instant::now();
    publish_in_chunks(&services.channel, topology, messages).await;
    let publish_seconds = publishing.elapsed().as_secs_f64();
    let mark = MEMORY_MARK.min(messages / 10).max(1) as u64;
    let progress = Arc::new(Progress {
        settled: AtomicU64::new(0),
        first_delivery: OnceLock::new(),
        mark,
        at_mark: OnceLock::new(),
    });
    let stack = full_stack_batched(services, progress.clone()).await;
    let route = Route::new("bench-long", KeyExtractor::json_pointer("/orderId"), stack);
    let runner = Runner::new(route, topology.clone());
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { runner.run_with_reconnect(connect, &shutdown).await })
    };
    let started = loop {
        if let Some(first) = progress.first_delivery.get() {
            break *first;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    let first_kib = resident_kib();
    let windows = sample(&progress, started, messages as u64, window).await;
    while ready_messages(&services.channel, topology.queue()).await > 0 {
        tokio::time::sleep(POLL).await;
    }
    shutdown.cancel();
    running.await.expect("the runner task").expect("the runner");
    let (at, resident_kib) = *progress.at_mark.get().expect("the mark's delivery settled");
    Run {
        messages,
        window,
        publish_seconds,
        first_kib,
        windows,
        mark: Mark {
            settled: mark,
            at: (at - started).as_secs_f64(),
            resident_kib,
        },
    }
}

/// Every `window` from `started` until `messages` have settled: the deliveries settled in the
/// window and the resident memory at its end. Windows end on the clock's marks, so that late
/// wake-ups do not add up, each counted from the previous one's reading.
async fn sample(progress: &Progress, started: Instant, messages: u64, window: Duration) -> Vec<Window> {
    let mut windows: Vec<Window> = Vec::new();
    let (mut from, mut counted) = (started, 0);
    loop {
        let boundary = started + window * (windows.len() as u32 + 1);
        while Instant::now() < boundary && progress.settled() < messages {
            tokio::time::sleep(POLL.min(boundary - Instant::now())).await;
        }
        let (now, settled) = (Instant::now(), progress.settled());
        let done = settled >= messages;
        windows.push(Window {
            start: (from - started).as_secs_f64(),
            end: (now - started).as_secs_f64(),
            settled: settled - counted,
            resident_kib: resident_kib(),
            full: !done,
        });
        if done {
            return windows;
        }
        (from, counted) = (now, settled);
    }
}

/// The two targets: memory flat after the mark, and no full window under half the median.
fn add_targets(report: &mut Report, run: &Run) {
    // A target is a floor on a ratio: "peak ≤ 1.10 × mark" is "mark / peak ≥ 1 / 1.10".
    let run_of = format!("Long run of {} messages", thousands(run.messages as f64));
    report.add_target(Target {
        what: format!(
            "{run_of}, resident memory at {} settled",
            thousands(run.mark.settled as f64)
        ),
        ratio: run.mark.resident_kib as f64 / run.peak_after_mark_kib().max(1) as f64,
        baseline: format!("its peak after them (flat: the peak at most {MEMORY_GROWTH:.2}× it)"),
        at_least: 1.0 / MEMORY_GROWTH,
    });
    // None without a full window, which the note says.
    if let Some(ratio) = run.slowest_ratio() {
        report.add_target(Target {
            what: format!("{run_of}, slowest full {}-s window", run.window.as_secs_f64()),
            ratio,
            baseline: "the median full window".into(),
            at_least: SLOWEST_WINDOW,
        });
    }
}

/// A row per window: its rate next to the median full window's.
fn rows(run: &Run) -> Vec<Row> {
    let median = run.median_rate();
    (run.windows.iter())
        .map(|window| Row {
            what: format!(
                "{:.1}–{:.1} s{}, resident memory {:.1} MiB",
                window.start,
                window.end,
                if window.full { "" } else { " (the last, partial)" },
                mib(window.resident_kib)
            ),
            in_flight: usize::from(DEFAULT_PREFETCH),
            per_second: window.per_second(),
            baseline: median,
            lowest_ratio: None,
        })
        .collect()
}

/// The note under the table: how the run went, the memory read, and the plot (or why it
/// is missing: `written`).
fn note(run: &Run, written: Result<(), String>) -> String {
    let plot = match written {
        Ok(()) => format!("![throughput and resident memory of the long run, window by window]({CHART})"),
        Err(error) => format!("The plot could not be written: {error}."),
    };
    let steady = match run.slowest_ratio() {
        Some(ratio) => format!(
            "The slowest full window carried {ratio:.2}× the median full window's {} messages a \
             second (at least {SLOWEST_WINDOW:.2}× is steady).",
            thousands(run.median_rate())
        ),
        None => "No window was full: the throughput was not checked.".to_owned(),
    };
    format!(
        "Published first, in chunks of {} (unconfirmed, each awaited until the queue held it), in \
         {:.1} s; then drained by the runner at its defaults, in the bench process, in {:.1} s: {} \
         messages a second overall. A delivery counts as settled in a window when the stack \
         answered for it (the record committed); the runner acks it right behind. The bench \
         process's resident memory (VmRSS): {:.1} MiB at the first delivery, {:.1} MiB as the \
         {}th delivery settled ({:.1} s in), at most {:.1} MiB after it ({:.2}× it; at most \
         {MEMORY_GROWTH:.2}× is flat). {steady}\n\n{plot}",
        thousands(CHUNK as f64),
        run.publish_seconds,
        run.seconds(),
        thousands(run.messages as f64 / run.seconds().max(f64::EPSILON)),
        mib(run.first_kib),
        mib(run.mark.resident_kib),
        thousands(run.mark.settled as f64),
        run.mark.at,
        mib(run.peak_after_mark_kib()),
        run.peak_after_mark_kib() as f64 / run.mark.resident_kib.max(1) as f64,
    )
}

/// Writes `svg` to [`CHART`] beside `BENCHMARKS.md`; or says why it was not drawn or
/// written.
fn write_chart(svg: Result<String, Box<dyn Error>>) -> Result<(), String> {
    let svg = svg.map_err(|error| format!("the plot: {error}"))?;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(CHART);
    std::fs::write(&path, svg).map_err(|error| format!("{}: {error}", path.display()))?;
    println!("\nwrote {CHART}");
    Ok(())
}

/// A panel of the plot: seconds from the first delivery across, a figure up.
type Plane<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The plot of `run` under `title`, two panels a colour each series: messages settled per
/// second window by window, with the floor (half the median full window) dashed; below,
/// the resident memory read at each window's end, the mark's reading marked and the
/// ceiling (1.10× it) dashed from there.
fn render(run: &Run, title: &str) -> Result<String, Box<dyn Error>> {
    let title = chart::title_lines(title);
    let height = chart::title_height(&title) + RATE_HEIGHT + MEMORY_HEIGHT + MARGIN;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let body = chart::draw_title(&root, &title)?;
        let (rates, memory) = body.split_vertically(RATE_HEIGHT);
        let colours = chart::palette(5);
        draw_rates(&rates, run, [colours[0], colours[1]])?;
        draw_memory(&memory, run, [colours[2], colours[3], colours[4]])?;
        root.present()?;
    }
    Ok(svg)
}

/// A panel of `area` from 0 to `run`'s last second across and 0 to `high` up (with room
/// above for the legend), its axes described.
fn plane<'a, 'b>(
    area: &'a chart::Area<'b>,
    run: &Run,
    high: f64,
    y_desc: &str,
) -> Result<Plane<'a, 'b>, Box<dyn Error>> {
    let mut plane = ChartBuilder::on(area)
        .margin(MARGIN)
        .x_label_area_size(AXIS_AREA)
        .y_label_area_size(Y_AXIS_AREA)
        .build_cartesian_2d(0.0..run.seconds().max(1.0), 0.0..high.max(1.0) * 1.4)?;
    plane
        .configure_mesh()
        // The bold lines alone: finer ones would only crowd the steps and readings.
        .max_light_lines(0)
        .x_desc("seconds from the first delivery")
        .y_desc(y_desc)
        .y_label_formatter(&|figure| thousands(*figure))
        .label_style((FONT, AXIS_SIZE))
        .draw()?;
    Ok(plane)
}

/// The legend of `plane`'s series, in its corner `at`: where the data leaves room.
fn legend<'a, 'b: 'a>(plane: &mut Plane<'a, 'b>, at: SeriesLabelPosition) -> Drawn {
    plane
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .label_font((FONT, TEXT_FACE.size))
        .draw()?;
    Ok(())
}

/// The legend's sample of a solid line of `style`.
fn solid(style: ShapeStyle) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style)
}

/// Draws a dashed line, level, between the two points of `segment` in `colour`, in the
/// legend as `label`.
fn level(plane: &mut Plane<'_, '_>, segment: [(f64, f64); 2], colour: RGBColor, label: String) -> Drawn {
    let style = colour.stroke_width(2);
    let dashes = DashedLineSeries::new(segment, 6, 4, style);
    (plane.draw_series(dashes)?)
        .label(label)
        .legend(move |(x, y)| DashedPathElement::new([(x, y), (x + 24, y)], 6, 4, style));
    Ok(())
}

/// What drawing returns: nothing, or plotters' error.
type Drawn = Result<(), Box<dyn Error>>;

/// Messages settled per second as a step a window, and the floor dashed.
fn draw_rates(area: &chart::Area<'_>, run: &Run, [line, floor]: [RGBColor; 2]) -> Drawn {
    let high = run.windows.iter().map(Window::per_second).fold(0.0, f64::max);
    let mut plane = plane(area, run, high, "messages settled per second")?;
    let rate = |window: &Window| [window.start, window.end].map(|at| (at, window.per_second()));
    let steps = run.windows.iter().flat_map(rate);
    let label = format!("settled per second, {}-s windows", run.window.as_secs_f64());
    (plane.draw_series(LineSeries::new(steps, line.stroke_width(2)))?)
        .label(label)
        .legend(solid(line.stroke_width(2)));
    let floor_rate = SLOWEST_WINDOW * run.median_rate();
    let floor_line = [(0.0, floor_rate), (run.seconds(), floor_rate)];
    let label = "the floor: half the median full window".to_owned();
    level(&mut plane, floor_line, floor, label)?;
    // Above the highest window: the axis runs 40 % past it.
    legend(&mut plane, SeriesLabelPosition::UpperRight)
}

/// The resident memory read at the first delivery, at the mark and at each window's end,
/// the mark's reading marked, and the ceiling dashed from the mark on.
fn draw_memory(area: &chart::Area<'_>, run: &Run, [line, mark, ceiling]: [RGBColor; 3]) -> Drawn {
    let at_mark = (run.mark.at, mib(run.mark.resident_kib));
    let ends = run
        .windows
        .iter()
        .map(|window| (window.end, mib(window.resident_kib)));
    let mut readings: Vec<(f64, f64)> = [(0.0, mib(run.first_kib)), at_mark]
        .into_iter()
        .chain(ends)
        .collect();
    readings.sort_by(|one, other| one.0.total_cmp(&other.0));
    let limit = MEMORY_GROWTH * at_mark.1;
    let high = readings.iter().map(|(_, mib)| *mib).fold(limit, f64::max);
    let mut plane = plane(area, run, high, "resident memory, MiB")?;
    (plane.draw_series(LineSeries::new(readings.iter().copied(), line.stroke_width(2)))?)
        .label("the bench process's resident memory (VmRSS)")
        .legend(solid(line.stroke_width(2)));
    plane.draw_series(readings.iter().map(|at| Circle::new(*at, 3, line.filled())))?;
    let settled = thousands(run.mark.settled as f64);
    (plane.draw_series([Circle::new(at_mark, 5, mark.filled())])?)
        .label(format!("as the {settled}th delivery settled"))
        .legend(move |(x, y)| Circle::new((x + 12, y), 5, mark.filled()));
    let ceiling_line = [(run.mark.at, limit), (run.seconds(), limit)];
    let label = format!("the ceiling: {MEMORY_GROWTH:.2}× that");
    level(&mut plane, ceiling_line, ceiling, label)?;
    // Below the readings: a process that has started holds tens of MiB from the first.
    legend(&mut plane, SeriesLabelPosition::LowerRight)
}
