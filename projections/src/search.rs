//! Search projection: a full-text index of room events for `POST /search` (spec v1.19
//! "Server Side Search"), kept by [tantivy] in its own directory beside the fjall tables
//! (`<projections>/search-index/`).
//!
//! What is indexed: `content.body` of every non-state event that has a string `body`
//! (`m.room.message`, `m.sticker`, ...), `content.name` of `m.room.name` and
//! `content.topic` of `m.room.topic` (the spec's three `keys`). Encrypted events have no
//! body and are not indexed. A redaction removes its target from the index if the target
//! is an event of the redaction's room (a redaction naming another room's event redacts
//! nothing, spec "Redactions"); a target redacted before it arrives is never added.
//!
//! Tables (layout [`LAYOUT`]; fjall, committed with the checkpoint like every projection):
//! - `redacted`: event id, 0x00, room id of the redaction -> the first such redaction.
//! - `index_state`: `changed_at` -> the position of the last record that changed the
//!   index (so a batch that changes nothing skips the tantivy commit, and start-up can
//!   tell an index that is merely older than the checkpoint from one that is behind).
//!
//! **Two stores, one checkpoint.** tantivy and fjall cannot commit in one batch, so the
//! order is fixed: tantivy commits first, with the checkpoint as its commit payload
//! ([`Projection::prepare_commit`]; skipped when the batch changed nothing), then the
//! runtime commits the fjall tables and the checkpoint. A crash between the two leaves
//! tantivy *ahead* of the fjall checkpoint; the runtime then re-applies those records,
//! and apply is idempotent on the index: an add first deletes the event's document in
//! its room (only for positions tantivy may already hold), a redaction deletes it
//! again. tantivy
//! *behind* (its payload below `changed_at`: its directory lost or unreadable) cannot be
//! repaired by re-applying, so [`Search::open`] resets the projection (tables and
//! checkpoint) and the index is rebuilt by replay. A fresh checkpoint (0: `replay
//! rebuild search`, a deleted `projections/`) clears the index.
//!
//! **What the digest sees.** The events the index holds, read from its fast fields
//! ([`Projection::outside_rows`]: event id -> room id and position, in event id order),
//! a function of the records however tantivy laid out its segments. Until layout 2 a
//! `docs` table kept the same per event beside the index (about 130 bytes an event on
//! disk, issue 18 item 5); the index itself is the witness now.
//!
//! **Memory.** One indexing thread with an explicit heap budget
//! ([`SearchOptions::writer_heap_bytes`], at least tantivy's 15 MB minimum) and one merge
//! thread; readers use tantivy's memory-mapped segments.
//!
//! **Cost.** A query is an index lookup (postings of the search words, intersected with
//! the room, sender and type terms); the room's size does not enter. The candidates it
//! returns are identified by fast fields (event id, room id, position), not by reading
//! documents.

use std::{
    ops::Bound,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use parking_lot::Mutex;
use spindle_journal::{Interest, StoredRecord};
use tantivy::{
    DocAddress, Index, IndexReader, IndexWriter, ReloadPolicy, Searcher, SegmentReader,
    TantivyDocument, Term,
    collector::TopDocs,
    directory::MmapDirectory,
    indexer::IndexWriterOptions,
    query::{
        BooleanQuery, ConstScoreQuery, Occur, Query, RangeQuery, RegexQuery, TermQuery,
        TermSetQuery,
    },
    schema::{
        FAST, Field, INDEXED, IndexRecordOption, STRING, Schema, TextFieldIndexing, TextOptions,
    },
};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table},
};

/// The directory of the index, inside the projections directory (fjall ignores
/// sub-directories it did not create, and the index is as disposable as the tables).
pub const INDEX_DIR: &str = "search-index";

/// tantivy's smallest writer heap (its `MEMORY_BUDGET_NUM_BYTES_MIN`, 15 MB).
pub const WRITER_HEAP_BYTES_MIN: usize = 15_000_000;

/// Default writer heap budget: 32 MiB.
pub const WRITER_HEAP_BYTES_DEFAULT: usize = 32 * 1024 * 1024;

/// How long the search index gathers records before it applies and commits them
/// ([`Projection::gather_ms`]).
pub const SEARCH_GATHER_MS: u64 = 1000;

/// Settings of the search projection.
#[derive(Debug, Clone, Copy)]
pub struct SearchOptions {
    /// Heap budget of the index writer, bytes (buffered documents are flushed to a new
    /// segment when it fills). Raised to [`WRITER_HEAP_BYTES_MIN`] if lower.
    pub writer_heap_bytes: usize,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            writer_heap_bytes: WRITER_HEAP_BYTES_DEFAULT,
        }
    }
}

/// The version of this projection's row shapes ([`ProjectionDb::ensure_layout`]): 2
/// dropped the `docs` table and keyed `redacted` by (target, room).
pub const LAYOUT: u32 = 2;

/// What the index holds for one event ([`Search::indexed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexedEvent {
    /// The event.
    pub event_id: String,
    /// Its room.
    pub room_id: String,
    /// Its journal position.
    pub position: u64,
}

/// Result order (spec: `order_by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchOrder {
    /// Best BM25 score first; equal scores newest first.
    Rank,
    /// Newest first (by journal position).
    Recent,
}

/// Which content fields a search looks in (spec: `keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchKeys {
    /// `content.body`.
    pub body: bool,
    /// `content.name`.
    pub name: bool,
    /// `content.topic`.
    pub topic: bool,
}

impl Default for SearchKeys {
    fn default() -> Self {
        SearchKeys {
            body: true,
            name: true,
            topic: true,
        }
    }
}

/// A hit's place in the result order: results come in descending key order, and a
/// page continues strictly below the last key of the previous one. For
/// [`SearchOrder::Rank`] it is (score bits, position), for [`SearchOrder::Recent`]
/// (position, score bits); scores are non-negative, so their `f32` bits order like the
/// scores. `(0, 0)` is below every hit (positions start at 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SortKey(pub u64, pub u64);

/// One search query over the index.
#[derive(Debug, Clone)]
pub struct SearchQuery {
    /// The words to find (every word must occur in one of the `keys`).
    pub words: Vec<String>,
    /// Fields to look in.
    pub keys: SearchKeys,
    /// Rooms to search (only these).
    pub rooms: Vec<String>,
    /// Only these senders, if set.
    pub senders: Option<Vec<String>>,
    /// Not these senders.
    pub not_senders: Vec<String>,
    /// Only these types, if set (`*` at the end: prefix).
    pub types: Option<Vec<String>>,
    /// Not these types (`*` at the end: prefix).
    pub not_types: Vec<String>,
    /// Only events with (true) or without (false) a string `content.url`.
    pub contains_url: Option<bool>,
    /// Order.
    pub order: SearchOrder,
    /// Continue strictly below this key (pagination).
    pub below: Option<SortKey>,
    /// At most this many hits.
    pub limit: usize,
}

/// One hit.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchHit {
    /// Event id.
    pub event_id: String,
    /// Room id.
    pub room_id: String,
    /// Journal position.
    pub position: u64,
    /// BM25 score.
    pub score: f32,
    /// Place in the order.
    pub key: SortKey,
}

/// Counters for counting tests: queries run and hits returned.
#[derive(Debug, Default)]
pub struct SearchStats {
    /// Index queries.
    pub queries: AtomicU64,
    /// Hits returned by those queries.
    pub hits: AtomicU64,
    /// Index commits (each writes a tantivy segment and feeds the merge threads).
    pub commits: AtomicU64,
}

#[derive(Clone, Copy)]
struct Fields {
    event_id: Field,
    room_id: Field,
    sender: Field,
    kind: Field,
    position: Field,
    has_url: Field,
    body: Field,
    name: Field,
    topic: Field,
}

fn schema() -> (Schema, Fields) {
    let mut b = Schema::builder();
    // Ranking needs term frequencies, not positions (no phrase queries).
    let text = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default()
            .set_tokenizer("default")
            .set_index_option(IndexRecordOption::WithFreqs),
    );
    let fields = Fields {
        event_id: b.add_text_field("event_id", STRING | FAST),
        room_id: b.add_text_field("room_id", STRING | FAST),
        sender: b.add_text_field("sender", STRING),
        kind: b.add_text_field("type", STRING),
        position: b.add_u64_field("position", INDEXED | FAST),
        has_url: b.add_u64_field("has_url", INDEXED),
        body: b.add_text_field("body", text.clone()),
        name: b.add_text_field("name", text.clone()),
        topic: b.add_text_field("topic", text),
    };
    (b.build(), fields)
}

/// The search projection.
pub struct Search {
    redacted: Table,
    index_state: Table,
    index: Index,
    writer: Mutex<IndexWriter>,
    reader: IndexReader,
    fields: Fields,
    /// The checkpoint of the index's last commit: records at or below it may already be
    /// in the index (a crash between the two commits), so adding one deletes first.
    index_checkpoint: AtomicU64,
    /// Whether the writer holds operations not yet committed.
    dirty: std::sync::atomic::AtomicBool,
    stats: Arc<SearchStats>,
}

/// The `index_state` key of the last position that changed the index.
const CHANGED_AT: &[u8] = b"changed_at";

fn terr(e: impl std::fmt::Display) -> String {
    format!("search index: {e}")
}

/// The checkpoint a commit of the index carries (its payload), 0 if none.
fn index_checkpoint(index: &Index) -> Result<u64, String> {
    let metas = index.load_metas().map_err(terr)?;
    Ok(metas
        .payload
        .as_deref()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0))
}

fn open_index(dir: &Path, schema: Schema) -> Result<Index, String> {
    std::fs::create_dir_all(dir).map_err(terr)?;
    let mmap = MmapDirectory::open(dir).map_err(terr)?;
    Index::open_or_create(mmap, schema).map_err(terr)
}

impl Search {
    /// Opens the tables and the index in `<projections dir>/search-index`, reconciling
    /// the two (module doc): a fresh checkpoint clears the index; an index behind the
    /// checkpoint or unreadable resets the projection so replay rebuilds it.
    pub fn open(db: &ProjectionDb, dir: &Path, options: SearchOptions) -> Result<Search, String> {
        let index_dir: PathBuf = dir.join(INDEX_DIR);
        let (schema, fields) = schema();
        let index = match open_index(&index_dir, schema.clone()) {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(error = %e, "search index unreadable: rebuilding it by replay");
                std::fs::remove_dir_all(&index_dir).map_err(terr)?;
                open_index(&index_dir, schema)?
            }
        };
        let mut index_cp = index_checkpoint(&index)?;
        let checkpoint = db.checkpoint("search");
        let changed_at = db
            .table("search", "index_state")?
            .get(CHANGED_AT)
            .filter(|v| v.len() == 8)
            .map(|v| u64::from_be_bytes(v[..8].try_into().expect("8 bytes")))
            .unwrap_or(0);
        let behind = changed_at > index_cp;
        if behind {
            tracing::warn!(
                checkpoint,
                changed_at,
                index_checkpoint = index_cp,
                "search index is behind its checkpoint: rebuilding it by replay"
            );
            db.reset_projection("search")?;
        }
        let heap = options.writer_heap_bytes.max(WRITER_HEAP_BYTES_MIN);
        let mut writer: IndexWriter = index
            .writer_with_options(
                IndexWriterOptions::builder()
                    .memory_budget_per_thread(heap)
                    .num_worker_threads(1)
                    .num_merge_threads(1)
                    .build(),
            )
            .map_err(terr)?;
        if checkpoint == 0 || behind {
            writer.delete_all_documents().map_err(terr)?;
            let mut commit = writer.prepare_commit().map_err(terr)?;
            commit.set_payload("0");
            commit.commit().map_err(terr)?;
            index_cp = 0;
        }
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(terr)?;
        Ok(Search {
            redacted: db.table("search", "redacted")?,
            index_state: db.table("search", "index_state")?,
            index,
            writer: Mutex::new(writer),
            reader,
            fields,
            index_checkpoint: AtomicU64::new(index_cp),
            dirty: std::sync::atomic::AtomicBool::new(false),
            stats: Arc::default(),
        })
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<SearchStats> {
        &self.stats
    }

    /// Number of documents the searchable index holds (committed ones).
    pub fn num_docs(&self) -> u64 {
        self.reader.searcher().num_docs()
    }

    /// The search term split into the index's words (lowercased; what `highlights`
    /// lists). Uses the same analyzer as indexing.
    pub fn words(&self, text: &str) -> Vec<String> {
        let mut analyzer = match self.index.tokenizer_for_field(self.fields.body) {
            Ok(a) => a,
            Err(_) => return vec![],
        };
        let mut stream = analyzer.token_stream(text);
        let mut out: Vec<String> = Vec::new();
        while stream.advance() {
            let t = stream.token().text.clone();
            if !out.contains(&t) {
                out.push(t);
            }
        }
        out
    }

    fn type_query(&self, pattern: &str) -> Result<Box<dyn Query>, String> {
        match pattern.strip_suffix('*') {
            Some(prefix) => Ok(Box::new(
                RegexQuery::from_pattern(&format!("{}.*", regex_escape(prefix)), self.fields.kind)
                    .map_err(terr)?,
            )),
            None => Ok(Box::new(TermQuery::new(
                Term::from_field_text(self.fields.kind, pattern),
                IndexRecordOption::Basic,
            ))),
        }
    }

    fn build(&self, q: &SearchQuery) -> Result<Option<BooleanQuery>, String> {
        let f = self.fields;
        let mut text_fields = Vec::new();
        if q.keys.body {
            text_fields.push(f.body);
        }
        if q.keys.name {
            text_fields.push(f.name);
        }
        if q.keys.topic {
            text_fields.push(f.topic);
        }
        if q.words.is_empty() || text_fields.is_empty() || q.rooms.is_empty() {
            return Ok(None);
        }
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = Vec::new();
        for word in &q.words {
            let per_field: Vec<(Occur, Box<dyn Query>)> = text_fields
                .iter()
                .map(|field| {
                    let tq: Box<dyn Query> = Box::new(TermQuery::new(
                        Term::from_field_text(*field, word),
                        IndexRecordOption::WithFreqs,
                    ));
                    (Occur::Should, tq)
                })
                .collect();
            clauses.push((Occur::Must, Box::new(BooleanQuery::new(per_field))));
        }
        let terms = |field: Field, values: &[String]| -> Box<dyn Query> {
            Box::new(TermSetQuery::new(
                values.iter().map(|v| Term::from_field_text(field, v)),
            ))
        };
        clauses.push(filter(terms(f.room_id, &q.rooms)));
        if let Some(senders) = &q.senders {
            clauses.push(filter(terms(f.sender, senders)));
        }
        if !q.not_senders.is_empty() {
            clauses.push((Occur::MustNot, terms(f.sender, &q.not_senders)));
        }
        if let Some(types) = &q.types {
            let any: Vec<(Occur, Box<dyn Query>)> = types
                .iter()
                .map(|t| Ok((Occur::Should, self.type_query(t)?)))
                .collect::<Result<_, String>>()?;
            clauses.push(filter(Box::new(BooleanQuery::new(any))));
        }
        for t in &q.not_types {
            clauses.push((Occur::MustNot, self.type_query(t)?));
        }
        if let Some(want) = q.contains_url {
            clauses.push(filter(Box::new(TermQuery::new(
                Term::from_field_u64(f.has_url, u64::from(want)),
                IndexRecordOption::Basic,
            ))));
        }
        if q.order == SearchOrder::Recent
            && let Some(below) = q.below
        {
            // Recent pages continue below a position: an index range, not a filter on hits.
            clauses.push(filter(Box::new(RangeQuery::new(
                Bound::Unbounded,
                Bound::Included(Term::from_field_u64(f.position, below.0)),
            ))));
        }
        Ok(Some(BooleanQuery::new(clauses)))
    }

    /// Runs a query: at most `q.limit` hits strictly below `q.below`, in descending
    /// [`SortKey`] order. Cost: the postings of the words and filter terms; hits are
    /// described from fast fields.
    pub fn search(&self, q: &SearchQuery) -> Result<Vec<SearchHit>, String> {
        self.stats.queries.fetch_add(1, Ordering::Relaxed);
        let Some(query) = self.build(q)? else {
            return Ok(vec![]);
        };
        if q.limit == 0 {
            return Ok(vec![]);
        }
        let searcher = self.reader.searcher();
        let order = q.order;
        let below = q.below.unwrap_or(SortKey(u64::MAX, u64::MAX));
        let collector = TopDocs::with_limit(q.limit).tweak_score(move |segment: &SegmentReader| {
            let positions = segment
                .fast_fields()
                .u64("position")
                .map(|c| c.first_or_default_col(0))
                .ok();
            move |doc, score: f32| {
                let pos = positions.as_ref().map(|c| c.get_val(doc)).unwrap_or(0);
                let bits = u64::from(score.max(0.0).to_bits());
                let key = match order {
                    SearchOrder::Rank => SortKey(bits, pos),
                    SearchOrder::Recent => SortKey(pos, bits),
                };
                if key < below { key } else { SortKey(0, 0) }
            }
        });
        let top: Vec<(SortKey, DocAddress)> = searcher.search(&query, &collector).map_err(terr)?;
        let mut out = Vec::with_capacity(top.len());
        for (key, addr) in top {
            if key == SortKey(0, 0) {
                continue;
            }
            let (event_id, room_id) = self.ids(&searcher, addr)?;
            let (position, score) = match order {
                SearchOrder::Rank => (key.1, f32::from_bits(key.0 as u32)),
                SearchOrder::Recent => (key.0, f32::from_bits(key.1 as u32)),
            };
            out.push(SearchHit {
                event_id,
                room_id,
                position,
                score,
                key,
            });
        }
        self.stats
            .hits
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(out)
    }

    fn ids(&self, searcher: &Searcher, addr: DocAddress) -> Result<(String, String), String> {
        IdColumns::open(searcher.segment_reader(addr.segment_ord))?.read(addr.doc_id)
    }

    /// Notes that the record at `position` changed the index (commit needed).
    fn changed(&self, ctx: &ApplyCtx, position: u64) {
        self.dirty.store(true, Ordering::Release);
        ctx.put(
            &self.index_state,
            CHANGED_AT.to_vec(),
            position.to_be_bytes().to_vec(),
        );
    }

    /// Every event the committed index holds, in (event id, room, position) order, read
    /// from the fast fields of its live documents (a scan of the whole index, held in
    /// memory: for digests, snapshots and tests, never a request). A document without
    /// its fast fields is an error.
    pub fn indexed(&self) -> Result<Vec<IndexedEvent>, String> {
        let searcher = self.reader.searcher();
        let mut out = Vec::with_capacity(searcher.num_docs() as usize);
        for segment in searcher.segment_readers() {
            let positions = segment
                .fast_fields()
                .u64("position")
                .map_err(terr)?
                .first_or_default_col(0);
            let ids = IdColumns::open(segment)?;
            for doc in segment.doc_ids_alive() {
                let (event_id, room_id) = ids.read(doc)?;
                out.push(IndexedEvent {
                    event_id,
                    room_id,
                    position: positions.get_val(doc),
                });
            }
        }
        // The whole row orders: one event id can be indexed in two rooms (room versions
        // 1 and 2 let the sending server pick ids), and segment order is not stable.
        out.sort_by(|a, b| {
            (&a.event_id, &a.room_id, a.position).cmp(&(&b.event_id, &b.room_id, b.position))
        });
        Ok(out)
    }
}

/// The event id and room id fast-field columns of one segment (opened once, read per
/// document).
struct IdColumns {
    event_id: tantivy::columnar::StrColumn,
    room_id: tantivy::columnar::StrColumn,
}

impl IdColumns {
    fn open(segment: &SegmentReader) -> Result<IdColumns, String> {
        let col = |name: &str| {
            segment
                .fast_fields()
                .str(name)
                .map_err(terr)?
                .ok_or_else(|| terr(format!("no fast field {name}")))
        };
        Ok(IdColumns {
            event_id: col("event_id")?,
            room_id: col("room_id")?,
        })
    }

    /// (event id, room id) of document `doc`.
    fn read(&self, doc: tantivy::DocId) -> Result<(String, String), String> {
        let text = |col: &tantivy::columnar::StrColumn| -> Result<String, String> {
            let ord = col
                .term_ords(doc)
                .next()
                .ok_or_else(|| terr("document without id"))?;
            let mut s = String::new();
            col.ord_to_str(ord, &mut s).map_err(terr)?;
            Ok(s)
        };
        Ok((text(&self.event_id)?, text(&self.room_id)?))
    }
}

/// The document of `event_id` in `room_id` (a delete query).
fn in_room(f: Fields, event_id: &str, room_id: &str) -> Box<dyn Query> {
    let both: Vec<(Occur, Box<dyn Query>)> = vec![
        (Occur::Must, Box::new(term_query(f.event_id, event_id))),
        (Occur::Must, Box::new(term_query(f.room_id, room_id))),
    ];
    Box::new(BooleanQuery::new(both))
}

/// A query for one exact term of a `STRING` field.
fn term_query(field: Field, text: &str) -> TermQuery {
    TermQuery::new(Term::from_field_text(field, text), IndexRecordOption::Basic)
}

/// A clause that must match and adds nothing to the score (ranks stay BM25 of the words).
fn filter(q: Box<dyn Query>) -> (Occur, Box<dyn Query>) {
    (Occur::Must, Box::new(ConstScoreQuery::new(q, 0.0)))
}

/// Escapes regex metacharacters (type prefixes become `prefix.*`).
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~\"<>@".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The searchable text of an event: (`body`, `name`, `topic`), any of them empty.
fn searchable(pdu: &spindle_core::pdu::Pdu) -> Option<(String, String, String, bool)> {
    let content = pdu.content_value();
    let text = |k: &str| {
        content
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let kind = pdu.kind.to_string();
    let (body, name, topic) = match (pdu.state_key.as_deref(), kind.as_str()) {
        (None, _) => (text("body"), String::new(), String::new()),
        (Some(""), "m.room.name") => (String::new(), text("name"), String::new()),
        (Some(""), "m.room.topic") => (String::new(), String::new(), text("topic")),
        _ => return None,
    };
    if body.is_empty() && name.is_empty() && topic.is_empty() {
        return None;
    }
    let has_url = content.get("url").is_some_and(|u| u.is_string());
    Some((body, name, topic, has_url))
}

impl Projection for Search {
    fn name(&self) -> &'static str {
        "search"
    }

    /// Room records only: a fact (a receipt, a login) does not wake it.
    fn interest(&self) -> Interest {
        Interest::ROOM
    }

    fn tables(&self) -> Vec<Table> {
        vec![self.redacted.clone(), self.index_state.clone()]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if !record.is_event() {
            return Ok(());
        }
        let pdu = record.pdu().ok_or("unreadable PDU")?;
        let f = self.fields;
        let event_id = pdu.event_id.to_string();
        let room_id = pdu.room_id.to_string();
        let writer = self.writer.lock();
        if pdu.kind.to_string() == "m.room.redaction"
            && let Some(target) = &pdu.redacts
        {
            let target = target.to_string();
            let k = crate::store::key::join(&[&target, &room_id]);
            if ctx.get(&self.redacted, &k).is_some() {
                return Ok(());
            }
            // Whether the index holds the target is not known without a search (its
            // buffered documents are not searchable yet): the delete is unconditional,
            // and matches only the target in this room. A redaction is rare; the
            // commit it costs when it deleted nothing is the price of not keeping a
            // row per indexed event. The delete goes first: if it fails, no `redacted`
            // row says it happened.
            writer
                .delete_query(in_room(f, &target, &room_id))
                .map_err(terr)?;
            ctx.put(&self.redacted, k, event_id.into_bytes());
            self.changed(ctx, record.position());
            return Ok(());
        }
        let Some((body, name, topic, has_url)) = searchable(&pdu) else {
            return Ok(());
        };
        if ctx
            .get(
                &self.redacted,
                &crate::store::key::join(&[&event_id, &room_id]),
            )
            .is_some()
        {
            return Ok(());
        }
        if record.position() <= self.index_checkpoint.load(Ordering::Acquire) {
            // The index may hold it already (module doc: tantivy ahead of fjall); only
            // this room's document (another room may hold the same id, in room
            // versions 1 and 2).
            writer
                .delete_query(in_room(f, &event_id, &room_id))
                .map_err(terr)?;
        }
        let mut doc = TantivyDocument::default();
        doc.add_text(f.event_id, &event_id);
        doc.add_text(f.room_id, &room_id);
        doc.add_text(f.sender, pdu.sender.as_str());
        doc.add_text(f.kind, pdu.kind.to_string());
        doc.add_u64(f.position, record.position());
        doc.add_u64(f.has_url, u64::from(has_url));
        for (field, text) in [(f.body, &body), (f.name, &name), (f.topic, &topic)] {
            if !text.is_empty() {
                doc.add_text(field, text);
            }
        }
        writer.add_document(doc).map_err(terr)?;
        self.changed(ctx, record.position());
        Ok(())
    }

    fn prepare_commit(&self, checkpoint: u64) -> Result<(), String> {
        let mut writer = self.writer.lock();
        if !self.dirty.load(Ordering::Acquire) {
            // Nothing changed: the index's payload stays at its last change, which
            // `changed_at` (committed with the tables) tells apart from "behind".
            return Ok(());
        }
        let result = (|| {
            let mut commit = writer.prepare_commit().map_err(terr)?;
            commit.set_payload(&checkpoint.to_string());
            commit.commit().map_err(terr)
        })();
        match result {
            Ok(_) => {
                self.stats.commits.fetch_add(1, Ordering::Relaxed);
                self.index_checkpoint
                    .fetch_max(checkpoint, Ordering::AcqRel);
                self.dirty.store(false, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                // Drop the batch's buffered operations; the runtime applies it again.
                let _ = writer.rollback();
                self.dirty.store(false, Ordering::Release);
                Err(e)
            }
        }
    }

    /// A tantivy commit costs milliseconds: `/search` waits for this projection alone
    /// instead of every request waiting for it (module doc of [`crate::runtime`]).
    fn gates_reads(&self) -> bool {
        false
    }

    /// A tantivy commit writes a segment and feeds the merge threads: one per message
    /// made indexing and merging 40% of the CPU of a run of single sends (perf, issue
    /// 18). Gathering records for up to this long first makes one segment of many.
    /// A search waits for the index alone and cuts the gathering short
    /// ([`Runtime::wait_for_projection`](crate::Runtime::wait_for_projection) hurries
    /// it), so a search right after a send does not wait for it.
    fn gather_ms(&self) -> u64 {
        SEARCH_GATHER_MS
    }

    fn committed(&self, _checkpoint: u64) {
        if let Err(e) = self.reader.reload() {
            tracing::error!(error = %e, "search index reader reload failed");
        }
    }

    /// The events the index holds: event id -> room id, 0x00, position (8 bytes, big
    /// endian). An unreadable index gives one row naming the error, so a digest
    /// differs rather than passing.
    fn outside_rows(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        match self.indexed() {
            Ok(docs) => docs
                .into_iter()
                .map(|d| {
                    let mut v = d.room_id.into_bytes();
                    v.push(0);
                    v.extend_from_slice(&d.position.to_be_bytes());
                    (d.event_id.into_bytes(), v)
                })
                .collect(),
            Err(e) => vec![(b"(unreadable index)".to_vec(), e.into_bytes())],
        }
    }

    /// The tables, then the index: one line per event it holds (`event id => room id
    /// @position`), in event id order.
    fn render(&self) -> String {
        let mut out = crate::render::render_tables(self.tables());
        match self.indexed() {
            Ok(docs) => {
                out.push_str(&format!("## search index ({} events)\n", docs.len()));
                for d in docs {
                    out.push_str(&format!(
                        "{} => {} @{}\n",
                        d.event_id, d.room_id, d.position
                    ));
                }
            }
            Err(e) => out.push_str(&format!("## search index unreadable: {e}\n")),
        }
        out
    }
}
