//! ggml tensor type ids and their block geometry, as GGUF files store them.
//!
//! This is a fact table of the file format. Which of these types have kernels is
//! decided in `quant`; the reader accepts every id listed here so that a loader
//! can refuse an unsupported tensor *by name* before allocating anything.

/// A ggml tensor type id as stored in a GGUF tensor info.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
}

impl GgmlType {
    /// Every type, for iteration in tests and tables.
    pub const ALL: [GgmlType; 33] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
    ];

    /// (id, name, elements per block, bytes per block)
    const fn info(self) -> (u32, &'static str, usize, usize) {
        match self {
            GgmlType::F32 => (0, "F32", 1, 4),
            GgmlType::F16 => (1, "F16", 1, 2),
            GgmlType::Q4_0 => (2, "Q4_0", 32, 18),
            GgmlType::Q4_1 => (3, "Q4_1", 32, 20),
            GgmlType::Q5_0 => (6, "Q5_0", 32, 22),
            GgmlType::Q5_1 => (7, "Q5_1", 32, 24),
            GgmlType::Q8_0 => (8, "Q8_0", 32, 34),
            GgmlType::Q8_1 => (9, "Q8_1", 32, 36),
            GgmlType::Q2_K => (10, "Q2_K", 256, 84),
            GgmlType::Q3_K => (11, "Q3_K", 256, 110),
            GgmlType::Q4_K => (12, "Q4_K", 256, 144),
            GgmlType::Q5_K => (13, "Q5_K", 256, 176),
            GgmlType::Q6_K => (14, "Q6_K", 256, 210),
            GgmlType::Q8_K => (15, "Q8_K", 256, 292),
            GgmlType::IQ2_XXS => (16, "IQ2_XXS", 256, 66),
            GgmlType::IQ2_XS => (17, "IQ2_XS", 256, 74),
            GgmlType::IQ3_XXS => (18, "IQ3_XXS", 256, 98),
            GgmlType::IQ1_S => (19, "IQ1_S", 256, 50),
            GgmlType::IQ4_NL => (20, "IQ4_NL", 32, 18),
            GgmlType::IQ3_S => (21, "IQ3_S", 256, 110),
            GgmlType::IQ2_S => (22, "IQ2_S", 256, 82),
            GgmlType::IQ4_XS => (23, "IQ4_XS", 256, 136),
            GgmlType::I8 => (24, "I8", 1, 1),
            GgmlType::I16 => (25, "I16", 1, 2),
            GgmlType::I32 => (26, "I32", 1, 4),
            GgmlType::I64 => (27, "I64", 1, 8),
            GgmlType::F64 => (28, "F64", 1, 8),
            GgmlType::IQ1_M => (29, "IQ1_M", 256, 56),
            GgmlType::BF16 => (30, "BF16", 1, 2),
            GgmlType::TQ1_0 => (34, "TQ1_0", 256, 54),
            GgmlType::TQ2_0 => (35, "TQ2_0", 256, 66),
            GgmlType::MXFP4 => (39, "MXFP4", 32, 17),
            // Four unsigned e4m3 scales (one per 16 values) and 64 four-bit e2m1 codes.
            GgmlType::NVFP4 => (40, "NVFP4", 64, 36),
        }
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }
    pub const fn id(self) -> u32 {
        self.info().0
    }
    pub const fn name(self) -> &'static str {
        self.info().1
    }
    /// Elements per block (1 for plain scalar types).
    pub const fn block_size(self) -> usize {
        self.info().2
    }
    /// Bytes per block.
    pub const fn type_size(self) -> usize {
        self.info().3
    }
    /// Bytes of a row of `n` elements, or None when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if n % self.block_size() != 0 {
            return None;
        }
        Some(n / self.block_size() * self.type_size())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// Block bytes from each layout's fields (f16 = 2 bytes): the table's sizes are
    /// what the blocks hold.
    #[test]
    fn block_bytes_are_the_sum_of_the_layout_fields() {
        let k = 256;
        let fields: [(GgmlType, usize, usize); 22] = [
            (GgmlType::Q4_0, 32, 2 + 16),
            (GgmlType::Q4_1, 32, 2 + 2 + 16),
            (GgmlType::Q5_0, 32, 2 + 4 + 16),
            (GgmlType::Q5_1, 32, 2 + 2 + 4 + 16),
            (GgmlType::Q8_0, 32, 2 + 32),
            (GgmlType::Q8_1, 32, 2 + 2 + 32),
            (GgmlType::Q2_K, k, k / 16 + k / 4 + 2 + 2),
            (GgmlType::Q3_K, k, k / 8 + k / 4 + 12 + 2),
            (GgmlType::Q4_K, k, 2 + 2 + 12 + k / 2),
            (GgmlType::Q5_K, k, 2 + 2 + 12 + k / 8 + k / 2),
            (GgmlType::Q6_K, k, k / 2 + k / 4 + k / 16 + 2),
            (GgmlType::Q8_K, k, 4 + k + 2 * k / 16),
            (GgmlType::IQ2_XXS, k, 2 + 2 * k / 8),
            (GgmlType::IQ2_XS, k, 2 + 2 * k / 8 + k / 32),
            (GgmlType::IQ2_S, k, 2 + k / 4 + k / 32 + k / 32),
            (GgmlType::IQ3_XXS, k, 2 + 3 * k / 8),
            (GgmlType::IQ3_S, k, 2 + k / 4 + k / 32 + k / 8 + k / 64),
            (GgmlType::IQ1_S, k, 2 + k / 8 + k / 16),
            (GgmlType::IQ1_M, k, k / 8 + k / 16 + k / 32),
            (GgmlType::IQ4_NL, 32, 2 + 16),
            (GgmlType::IQ4_XS, k, 2 + 2 + k / 64 + k / 2),
            (GgmlType::TQ2_0, k, k / 4 + 2),
        ];
        for (t, block, bytes) in fields {
            assert_eq!((t.block_size(), t.type_size()), (block, bytes), "{t}");
        }
        // TQ1_0: five base-3 digits per byte for 240 values, four per byte for 16, d.
        assert_eq!(GgmlType::TQ1_0.type_size(), 240 / 5 + 16 / 4 + 2);
        // MXFP4: one e8m0 scale byte and 32 four-bit codes.
        assert_eq!(GgmlType::MXFP4.type_size(), 1 + 16);
        // NVFP4: four e4m3 scale bytes and 64 four-bit codes.
        assert_eq!(GgmlType::NVFP4.type_size(), 4 + 32);
    }

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
        assert_eq!(GgmlType::from_id(4), None);
    }
}
