//! Axum Client-Server API: reads only projections, writes only by submitting commands to the journal
